export HISPARSE_HOME=/tmp/hh PYTHONPATH=$PWD; unset HISPARSE_DECODE_KERNEL
HISPARSE_GRAPH_SAMPLER=1 timeout 240 python3 -m pytest -q -m gpu tests/test_cuda_graph.py tests/test_graph_reuse.py tests/test_planner.py tests/test_cuda_step.py > $OUT/tests-gs1.txt 2>&1
echo "[tests gs=1] rc $? :: $(tail -1 $OUT/tests-gs1.txt)"; grep -E "^(FAILED|ERROR)" $OUT/tests-gs1.txt | head
timeout 90 python3 -m pytest -q -m gpu tests/test_planner.py > $OUT/tests-planner.txt 2>&1
echo "[tests planner, unset] rc $? :: $(tail -1 $OUT/tests-planner.txt)"; grep -E "^(FAILED|ERROR)" $OUT/tests-planner.txt | head
ORDER=1,0 SPECS="4060ti-6g_x h200-141g_--cli-sampling" bash benchmarks/gpu_graph_sampler_ab.sh
