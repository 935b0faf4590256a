"""Study (a): importance policies compared at equal KV budgets, with generation (ROUGE vs the
human references) and teacher-forced fidelity/attention recall.

Policies: uniform (evenly spaced, the naive baseline), attention (mass received while in the
window, H2O-like), snapkv (observation-window scoring), probe (the shipped learned probe).
Budgets: window 256 + 64 globals (~23% of dense KV at 2K tokens) and window 128 + 32 globals
(~12%). Documents: the first 3 of quality_common.SUBSET, truncated to 2048 tokens.

    python benchmarks/quality_policies.py [--docs 3] [--max-tokens 2048] [--out /tmp/quality_policies]
"""

from quality_common import parser, run_study

SPECS = ["dense"] + [f"{b}-{p}" for b in ("s4-w256-g64-r128-c64", "s4-w128-g32-r128-c64")
                     for p in ("uniform", "attention", "snapkv", "probe")]

if __name__ == "__main__":
    p = parser(__doc__, docs=3, max_tokens=2048, out="/tmp/quality_policies")
    p.add_argument("--no-rouge", action="store_true",
                   help="teacher-forced fidelity only (documents already checkpointed with "
                        "summaries keep them)")
    args = p.parse_args()
    run_study(args, SPECS, rouge=not args.no_rouge, title="policies (a)")
