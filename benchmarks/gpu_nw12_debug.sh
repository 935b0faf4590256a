# Which builds of the persistent step fault at the 8B shape (2 layers, h200-141g-like settings):
# each build in its own process (a fault ends the CUDA context), a short check of each.
export HISPARSE_HOME=$OUT/hh PYTHONPATH=$PWD; unset HISPARSE_DECODE_KERNEL
B="python3 benchmarks/gpu_cuda_decode.py --skip-time --check-shape llama-3-8b:2 --check-steps 6 --out $OUT"
i=0
for spec in "2 NW=12" "2 NW=12" "2 NW=12,STAGES=12" "2 NW=12,STAGES=12" "2 NW=12,STAGES=15" \
            "2 STAGES=14" "2 STAGES=14" "2 NW=8" "1 NW=12" "0 NW=12"; do
  set -- $spec; i=$((i+1))
  CUDA_LAUNCH_BLOCKING=1 timeout 120 $B --check-cases $1 --no-default-check --check-variants "$2" > $OUT/dbg$i.txt 2>&1
  echo "[$i case $1 $2] rc $? :: $(grep -h "^check \[\|CudaDriverError\|Error:" $OUT/dbg$i.txt | head -2 | cut -c1-190)"
done
