# The in-graph sampler on a GPU: its tests and argmax's, then the engine benchmark with the
# sampler off (unset) and on (HISPARSE_GRAPH_SAMPLER=1), at plain greedy and at the CLI's
# sampler settings (--cli-sampling: penalty 1.1, n-gram 8). Each run in its own process.
export HISPARSE_HOME=/tmp/hh PYTHONPATH=$PWD; unset HISPARSE_DECODE_KERNEL
timeout 200 python3 -m pytest -q -m gpu tests/test_cuda_graph.py tests/test_argmax_triton.py \
  -k "graph_sampler or waits_for_the_device or greedy or argmax" > $OUT/tests.txt 2>&1
echo "[tests] rc $? :: $(tail -1 $OUT/tests.txt)"; grep -E "^(FAILED|ERROR)" $OUT/tests.txt | head -5
E="python3 benchmarks/gpu_engine.py --awq-vs-fp16 --awq-lm-head --reuse-engine --repeat 2 --contexts 32768 --decode-tokens 256 --budget-gib 0 --skip-static"
for spec in ${SPECS:-"h200-141g 0 x" "h200-141g 1 x" "h200-141g 0 --cli-sampling" "h200-141g 1 --cli-sampling" "4060ti-6g 0 x" "4060ti-6g 1 x"}; do
  set -- $spec; extra=$3; [ "$extra" = x ] && extra=
  name=$1-gs$2${extra:+-cli}
  HISPARSE_GRAPH_SAMPLER=$2 timeout ${EACH:-100} $E --awq-profile $1 $extra --out $OUT/$name > $OUT/$name.txt 2>&1
  echo "[$name] rc $? ::"; grep -hE "\(e\).*(decode .* tok/s|INT4/fp16)" $OUT/$name.txt | sed 's/, peak.*by repeat/; by repeat/' | cut -c1-170
done
