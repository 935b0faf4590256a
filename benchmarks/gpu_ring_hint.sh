# Twenty-eighth session, second call: the ring's loads under L2 evict_first (RING_HINT=1, the
# new default) through the GPU tests, the decode benchmark against RING_HINT=0 / 2 and
# ATT_COMBINE=1 in one process (both profiles, the fp16 peer before and after), then the
# engine benchmark at the CLI's sampler settings (h200-141g).
export HISPARSE_HOME=/tmp/hh PYTHONPATH=$PWD; unset HISPARSE_DECODE_KERNEL
timeout 150 python3 -m pytest -q -m gpu tests/test_cuda_step.py -k "triton_step or ring_goes_round" > $OUT/tests.txt 2>&1
echo "[tests] rc $? :: $(tail -1 $OUT/tests.txt)"; grep -E "^(FAILED|ERROR)" $OUT/tests.txt | head
timeout 300 python3 benchmarks/gpu_cuda_decode.py --check-steps 2 --check-cases 2 --repeat 2 \
  --check-variants "RING_HINT=2" --systems fp16/layers,int4+head/persistent --variant-decode \
  --peer-again --variants "RING_HINT=0;RING_HINT=2;ATT_COMBINE=1" > $OUT/decode.txt 2>&1
echo "[decode] rc $?"; grep -E "^check|step_ms|tok/s|x fp16|\[|Error|error" $OUT/decode.txt | grep -v Warning | head -60
timeout 120 python3 benchmarks/gpu_engine.py --awq-vs-fp16 --awq-lm-head --awq-profile h200-141g \
  --reuse-engine --repeat 2 --contexts 32768 --decode-tokens 256 --budget-gib 0 --skip-static \
  --cli-sampling > $OUT/engine.txt 2>&1
echo "[engine cli-sampling] rc $?"; tail -12 $OUT/engine.txt
