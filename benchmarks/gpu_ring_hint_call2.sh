# Twenty-eighth session, third call: the sampler's past-capacity fix on the GPU (the profile's
# replays with the CLI's settings crashed in run 161), the graph tests with the new kernel
# default, and the engine benchmark at the CLI's settings for 4060ti-6g.
export HISPARSE_HOME=/tmp/hh PYTHONPATH=$PWD; unset HISPARSE_DECODE_KERNEL
timeout 100 python3 benchmarks/gpu_decode_profile.py --awq --awq-lm-head --contexts 32768 \
  --decode-tokens 256 --no-scoring --cli-sampling > $OUT/profile-cli.txt 2>&1
echo "[profile --cli-sampling] rc $?"; grep -E "ctx|^ +32768|errors|Error" $OUT/profile-cli.txt | head -8
timeout 170 python3 -m pytest -q -m gpu tests/test_cuda_graph.py tests/test_graph_sampler.py tests/test_graph_reuse.py > $OUT/tests.txt 2>&1
echo "[tests] rc $? :: $(tail -1 $OUT/tests.txt)"; grep -E "^(FAILED|ERROR)" $OUT/tests.txt | head
timeout 100 python3 benchmarks/gpu_engine.py --awq-vs-fp16 --awq-lm-head --awq-profile 4060ti-6g \
  --reuse-engine --repeat 2 --contexts 32768 --decode-tokens 256 --budget-gib 0 --skip-static \
  --cli-sampling > $OUT/engine.txt 2>&1
echo "[engine 4060ti-6g cli-sampling] rc $?"; grep -E "\(e\)" $OUT/engine.txt | tail -6
