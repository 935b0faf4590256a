#!/usr/bin/env bash
# Cold vs warm INT4 record on a freshly started GPU machine (GPU_NOTES, thirteenth session:
# INT4 ran 326 tok/s decode and 0.73x fp16 prefill from an idle machine, 345 and 0.9-1.1x
# after minutes of load). Is the host the cause? Sequence, all logged to $OUT:
#   host/GPU snapshot -> record A (cold) -> 45 s CPU-only burn on every core (no GPU work)
#   -> record B -> record C
# with background samplers of the CPU clock (cpu_mhz.log, every second) and the GPU's clocks
# and power (dmon.log), and a host launch probe (torch.add launches, us each) before each
# record. Usage: OUT=dir bash benchmarks/gpu_cold_probe.sh
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
REC="python3 benchmarks/gpu_engine.py --awq-vs-fp16 --contexts 32768 --decode-tokens 256 --repeat 2 --budget-gib 0 --skip-static"

snap() {
  {
    echo "== $1 $(date -u +%T)"
    uptime
    awk '/MHz/ {s += $4; n++; if ($4 > m) m = $4} END {printf "cpu MHz mean %.0f max %.0f (%d cpus)\n", s / n, m, n}' /proc/cpuinfo
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active --format=csv,noheader
    ps -eo pcpu,comm --sort=-pcpu | head -6
  } >> "$OUT/env.log" 2>&1
}

launch_probe() {
  python3 - "$1" >> "$OUT/launch.log" 2>&1 <<'EOF'
import sys, time, torch
x = torch.zeros(16, device="cuda")
for _ in range(2000):
    x.add_(1)
torch.cuda.synchronize()
best = []
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(5000):
        x.add_(1)
    best.append((time.perf_counter() - t0) / 5000 * 1e6)
    torch.cuda.synchronize()
print(f"{sys.argv[1]}: torch.add launch us (5 x 5000): " + " ".join(f"{b:.2f}" for b in best))
EOF
}

{
  echo "# static"
  lscpu
  cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null || echo "no cpufreq governor exposed"
  nvidia-smi topo -m
  nvidia-smi -q -d PERFORMANCE
} > "$OUT/static.log" 2>&1

(while :; do
  awk -v t="$(date -u +%T)" '/MHz/ {s += $4; n++} END {printf "%s %.0f\n", t, s / n}' /proc/cpuinfo
  sleep 1
done) > "$OUT/cpu_mhz.log" 2>&1 &
SAMPLER=$!
nvidia-smi dmon -s pc -d 1 > "$OUT/dmon.log" 2>&1 &
DMON=$!

snap "before A"; launch_probe "before A"
echo "== record A (cold) $(date -u +%T)"; $REC --out "$OUT/a" 2>&1 | grep "(e)"
snap "after A"
echo "== CPU-only burn 45 s on $(nproc) cores $(date -u +%T)"
python3 - <<'EOF'
import multiprocessing as mp, time
def spin(_):
    t = time.time() + 45
    n = 0
    while time.time() < t:
        n += 1
    return n
with mp.Pool(mp.cpu_count()) as p:
    print("burn loops", sum(p.map(spin, range(mp.cpu_count()))))
EOF
snap "before B"; launch_probe "before B"
echo "== record B (after the CPU burn) $(date -u +%T)"; $REC --out "$OUT/b" 2>&1 | grep "(e)"
snap "before C"; launch_probe "before C"
echo "== record C $(date -u +%T)"; $REC --out "$OUT/c" 2>&1 | grep "(e)"
snap "end"
kill $SAMPLER $DMON 2>/dev/null
cat "$OUT/launch.log"
