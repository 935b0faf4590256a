# What each stage of the persistent step around its weights costs (twenty-eighth session):
# the XSKIP diagnostic builds leave out one stage each (wrong results; timing only), with the
# phase timelines; then the decode loop's profile with the sampler in the graph, to see what a
# token costs outside the kernel (bounds a multi-step graph).
export HISPARSE_HOME=/tmp/hh PYTHONPATH=$PWD; unset HISPARSE_DECODE_KERNEL
timeout 300 python3 benchmarks/gpu_cuda_decode.py --check-steps 2 --check-cases 2 --repeat 2 \
  --profiles h200-141g --systems int4+head/persistent --variant-timelines \
  --variants "XSKIP=1;XSKIP=2;XSKIP=3;XSKIP=4;XSKIP=8;XSKIP=16;XSKIP=32;XSKIP=64;XSKIP=127" \
  > $OUT/xskip.txt 2>&1
echo "[xskip] rc $?"; grep -E "step_ms|crit|phases_us|Error|error" $OUT/xskip.txt | head -80
for extra in "" "--cli-sampling"; do
  timeout 100 python3 benchmarks/gpu_decode_profile.py --awq --awq-lm-head --contexts 32768 \
    --decode-tokens 256 --no-scoring $extra > $OUT/profile$extra.txt 2>&1
  echo "[profile $extra] rc $?"; tail -25 $OUT/profile$extra.txt
done
HISPARSE_GRAPH_SAMPLER=0 timeout 100 python3 benchmarks/gpu_decode_profile.py --awq --awq-lm-head \
  --contexts 32768 --decode-tokens 256 --no-scoring > $OUT/profile-gs0.txt 2>&1
echo "[profile GRAPH_SAMPLER=0] rc $?"; tail -25 $OUT/profile-gs0.txt
