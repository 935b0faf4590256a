# The in-graph sampler A/B in one process per setting: each system with HISPARSE_GRAPH_SAMPLER
# 0 and 1 (an Engine each, repeats interleaved, decode = median after the first).
export HISPARSE_HOME=/tmp/hh PYTHONPATH=$PWD; unset HISPARSE_DECODE_KERNEL HISPARSE_GRAPH_SAMPLER
E="python3 benchmarks/gpu_engine.py --awq-vs-fp16 --awq-lm-head --reuse-engine --ab-graph-sampler --repeat ${REPEAT:-4} --ab-order ${ORDER:-0,1} --contexts 32768 --decode-tokens 256 --budget-gib 0 --skip-static"
for spec in ${SPECS:-h200-141g_x h200-141g_--cli-sampling 4060ti-6g_x}; do  # profile_extra
  set -- ${spec/_/ }; extra=$2; [ "$extra" = x ] && extra=
  name=ab-$1${extra:+-cli}${ORDER:+-o${ORDER/,/}}
  timeout ${EACH:-170} $E --awq-profile $1 $extra --out $OUT/$name > $OUT/$name.txt 2>&1
  echo "[$name] rc $? ::"; grep -hE "\(e\).*(decode .* tok/s|INT4/fp16)" $OUT/$name.txt | sed 's/, peak.*by repeat/; by repeat/' | cut -c1-190
done
