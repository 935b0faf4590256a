"""Held-out perplexity of a model in fp32, INT4 round-to-nearest and INT4 AWQ (same group size).

Calibration: the first 75% of every samples/ document; held out: the remaining 25% (split at
a line break). Both INT4 folders are written by `quantize_model` (method rtn / awq) and loaded
back through our loader, so the numbers include packing, export and the INT4 linear.

    python benchmarks/awq_perplexity.py [--model DIR] [--group-size 64] [--head] [--json out.json]

--head adds the output head's rows: AWQ with `quantize_lm_head` (the activation-aware head of
`hisparse quantize --quantize-lm-head`), and the AWQ body with its head rounded to nearest
(awq_pack.fake_quantize, at the group size and at 32) in place of the fp head.

Default model: the embedded SmolLM2-135M (resolve_model(None)), falling back to /tmp/smollm2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def default_model() -> Path:
    try:
        from hisparse_cli.hub.resolve import resolve_model

        return resolve_model(None, auto_pull=False)
    except Exception as exc:  # not pulled yet: the folder built by hand for experiments
        print(f"resolve_model(None) failed ({exc}); using /tmp/smollm2", file=sys.stderr)
        return Path("/tmp/smollm2")


def run(model_dir: Path, group_size: int, seq_len: int, samples: int, work: Path,
        head: bool = False) -> dict:
    import torch
    from transformers import AutoTokenizer

    from hisparse_cli.model.loader import load_model
    from hisparse_cli.quantize.api import quantize_model
    from hisparse_cli.quantize.calibration import default_calibration_texts
    from hisparse_cli.quantize.evaluate import perplexity, split_texts, token_windows

    torch.manual_seed(0)
    calib, held = split_texts(default_calibration_texts())
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    windows = token_windows(tok, held, seq_len)
    rows = {}
    fp, _ = load_model(model_dir, "cpu", torch.float32)
    rows["fp32"] = perplexity(fp, windows)
    del fp
    reports = {}
    runs = [("rtn", "rtn", False), ("awq", "awq", False)]
    if head:
        runs.append(("awq+head", "awq", True))
    for name, method, qhead in runs:
        def progress(stage, done, total, m=name):
            if stage == "layer":
                print(f"\r{m}: layer {done}/{total}", end="", file=sys.stderr, flush=True)
        t = time.perf_counter()
        rep = quantize_model(model_dir, work / name, calib_texts=calib, group_size=group_size,
                             n_samples=samples, seq_len=seq_len, method=method,
                             progress=progress, quantize_lm_head=qhead)
        print(f" ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
        reports[name] = rep
        q, _ = load_model(work / name, "cpu", torch.float32)
        rows[f"int4-{name}"] = perplexity(q, windows)
        if head and name == "awq":  # the same body with its fp head rounded to nearest
            from hisparse_cli.kernels.int4.awq_pack import fake_quantize

            w = q.lm_head.weight.detach().clone()
            for g in sorted({group_size, 32}, reverse=True):
                q.lm_head.weight = torch.nn.Parameter(fake_quantize(w, g), requires_grad=False)
                rows[f"int4-awq+rtn-head-g{g}"] = perplexity(q, windows)
    base = rows["fp32"][0]
    result = {
        "model": str(model_dir), "group_size": group_size, "seq_len": seq_len,
        "calib_blocks": reports["awq"].n_samples, "calib_tokens": reports["awq"].calib_tokens,
        "heldout_tokens": rows["fp32"][1],
        "perplexity": {k: v[0] for k, v in rows.items()},
        "increase_over_fp_pct": {k: 100 * (v[0] / base - 1) for k, v in rows.items()},
        "awq_calib_loss_ratio": reports["awq"].loss_ratio,
        "size_bytes": {m: r.size_bytes for m, r in reports.items()},
        "quantize_seconds": {m: r.seconds for m, r in reports.items()},
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--head", action="store_true", help="also the INT4 output head rows")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model_dir = args.model or default_model()
    with tempfile.TemporaryDirectory() as tmp:
        res = run(model_dir, args.group_size, args.seq_len, args.samples, Path(tmp), args.head)
    print(f"model {res['model']}  group {res['group_size']}  calib {res['calib_tokens']} tokens "
          f"({res['calib_blocks']} blocks)  held-out {res['heldout_tokens']} tokens")
    print(f"{'weights':<22} {'perplexity':>10} {'vs fp32':>9}")
    for k, v in res["perplexity"].items():
        print(f"{k:<22} {v:>10.3f} {res['increase_over_fp_pct'][k]:>+8.2f}%")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
