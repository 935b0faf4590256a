# Twenty-eighth session: the o GEMV's one-trip split combine (ATT_COMBINE=1, the new default)
# checked and timed against the old (ATT_COMBINE=0), and the fused MLP's weights prefetched
# into L2 during the short phases (MLP_PF, MLP_PF_AHEAD, RING_HINT variants).
export HISPARSE_HOME=/tmp/hh PYTHONPATH=$PWD; unset HISPARSE_DECODE_KERNEL
timeout 150 python3 -m pytest -q -m gpu tests/test_cuda_step.py -k "triton_step or ring_goes_round" > $OUT/tests.txt 2>&1
echo "[tests] rc $? :: $(tail -1 $OUT/tests.txt)"; grep -E "^(FAILED|ERROR)" $OUT/tests.txt | head
timeout 420 python3 benchmarks/gpu_cuda_decode.py --check-steps 2 --check-cases 2 --repeat 2 \
  --check-variants "ATT_COMBINE=0;MLP_PF=24,RING_HINT=2" \
  --systems fp16/layers,int4+head/persistent --variant-timelines --variant-decode --peer-again \
  --variants "${VARIANTS:-ATT_COMBINE=0;MLP_PF=16;MLP_PF=24;MLP_PF=32;MLP_PF=24,MLP_PF_AHEAD=2;MLP_PF=24,RING_HINT=1;MLP_PF=24,RING_HINT=2;RING_HINT=1}" \
  > $OUT/decode.txt 2>&1
echo "[decode] rc $?"; grep -E "^check|step_ms|crit|phases_us|tok/s|x fp16|vs_fp16|^\S+ +\[|Error|error" $OUT/decode.txt | head -150
