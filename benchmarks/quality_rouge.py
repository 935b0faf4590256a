"""ROUGE with generation over more documents: dense vs the default sparse settings and the
small-KV settings of the policy study (attention importance, and the evenly spaced baseline
at the smallest budget). Documents: the first 6 of quality_common.SUBSET (three genres),
truncated to 2048 tokens; 160 new tokens, greedy, the CLI's repetition control.

    python benchmarks/quality_rouge.py [--docs 6] [--max-tokens 2048] [--out /tmp/quality_rouge]
"""

from quality_common import parser, run_study

SPECS = ["dense", "s4-w1024-g64-r256-c256-attention", "s4-w256-g64-r128-c64-attention",
         "s4-w128-g32-r128-c64-attention", "s4-w128-g32-r128-c64-uniform"]

if __name__ == "__main__":
    args = parser(__doc__, docs=6, max_tokens=2048, out="/tmp/quality_rouge").parse_args()
    run_study(args, SPECS, rouge=True, title="ROUGE over 6 documents")
