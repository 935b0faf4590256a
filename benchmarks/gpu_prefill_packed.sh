#!/usr/bin/env bash
# The fused INT4 GEMM's prefill sweep (gpu_awq.py --prefill-sweep) with the packed fp16
# dequantization (awq_gemm_k.GEMM_PACKED, the default) and without it, one after the other,
# each against dequantize + cuBLAS and fp16 cuBLAS. Logs and JSON to $OUT/packed, $OUT/unpacked.
#     OUT=$OUT bash benchmarks/gpu_prefill_packed.sh [budget seconds per sweep, default 200]
set -u
cd "$(dirname "$0")"
export PYTHONPATH="$PWD/..:$PWD"
budget="${1:-200}"
for mode in packed unpacked; do
  mkdir -p "$OUT/$mode"
  OUT="$OUT/$mode" timeout $((budget + 60)) python3 -c "
import runpy, sys
sys.argv = ['gpu_awq.py', '--quick', '--prefill-sweep', '--no-timing', '--budget-s', '$budget']
from hisparse_cli.kernels.int4 import awq_gemm_k
awq_gemm_k.GEMM_PACKED = '$mode' == 'packed'
runpy.run_path('gpu_awq.py', run_name='__main__')
" 2>&1 | grep -v Warning | tee "$OUT/$mode/run.log" | grep -E "m=|suggest|correctness"
done
