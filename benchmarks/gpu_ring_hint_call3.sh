# Twenty-eighth session, fourth call: the h200-141g ratio again with the new default (RING_HINT=1),
# the engine at plain greedy and at the CLI's settings, and the decode benchmark (peer twice).
export HISPARSE_HOME=/tmp/hh PYTHONPATH=$PWD; unset HISPARSE_DECODE_KERNEL
for extra in "" "--cli-sampling"; do
  timeout 100 python3 benchmarks/gpu_engine.py --awq-vs-fp16 --awq-lm-head --awq-profile h200-141g \
    --reuse-engine --repeat 2 --contexts 32768 --decode-tokens 256 --budget-gib 0 --skip-static \
    $extra > $OUT/engine$extra.txt 2>&1
  echo "[engine h200-141g $extra] rc $?"; grep -E "\(e\)" $OUT/engine$extra.txt | tail -5
done
timeout 150 python3 benchmarks/gpu_cuda_decode.py --check-steps 2 --check-cases 2 --repeat 2 \
  --profiles h200-141g --systems fp16/layers,int4+head/persistent --peer-again > $OUT/decode.txt 2>&1
echo "[decode] rc $?"; grep -E "^check|tok/s|x fp16|^int4|^fp16" $OUT/decode.txt | head -20
