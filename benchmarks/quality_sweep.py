"""Study (b): one-factor-at-a-time sweep of the sparse settings around a centre point, with
teacher-forced fidelity and attention recall only (no generation: cheap).

Centre: sinks 4, window 256, 64 globals (attention importance, score stride 4), candidate
pool 64, recalibration every 128 tokens, prefill chunk 64. Each line of SPECS changes one
knob. Documents: the first 3 of quality_common.SUBSET, truncated to 2048 tokens.

    python benchmarks/quality_sweep.py [--docs 3] [--max-tokens 2048] [--out /tmp/quality_sweep]
"""

from quality_common import parser, run_study

C = "s4-w256-g64-k64-r128-c64"
SPECS = ["dense", C,
         "s4-w128-g64-k64-r128-c64", "s4-w512-g64-k64-r128-c64", "s4-w1024-g64-k64-r128-c64",
         "s4-w256-g0-k0-r128-c64", "s4-w256-g16-k16-r128-c64", "s4-w256-g256-k256-r128-c64",
         "s4-w256-g64-k64-r32-c64", "s4-w256-g64-k64-r512-c64",
         "s4-w256-g64-k16-r128-c64", "s4-w256-g64-k256-r128-c64",
         "s0-w256-g64-k64-r128-c64", "s16-w256-g64-k64-r128-c64",
         "s4-w256-g64-k64-r128-c64-t1"]

if __name__ == "__main__":
    args = parser(__doc__, docs=3, max_tokens=2048, out="/tmp/quality_sweep").parse_args()
    run_study(args, SPECS, rouge=False, title="sweep (b)")
