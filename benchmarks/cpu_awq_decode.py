"""CPU: an AWQ INT4 model through the engine with the packed int4 decode path
(kernels/int4/awq_cpu.py, the CPU default) against the exact fp32 reference path
(HISPARSE_BACKEND=torch) and the unquantized fp32 model, same prompt, greedy, in one run.

The INT4 checkpoint is round-to-nearest (group 64) of the model's own weights, written once
to a temporary folder (`hisparse quantize` output can be passed with --awq instead). Each
variant runs in its own subprocess (the backend is chosen per process; peak RSS per
variant), rounds alternate the order.

    python benchmarks/cpu_awq_decode.py [--model DIR] [--awq DIR] [--doc FILE]
        [--prompt-tokens 2000] [--new-tokens 64] [--rounds 2] [--json OUT.json]
    python benchmarks/cpu_awq_decode.py --fidelity 400 [--json OUT.json]   (quality instead)
Default model: the embedded SmolLM2-135M (hisparse models path smollm2-135m-instruct).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
DEFAULT_DOC = ROOT.parent / "shared" / "eval_dev" / "gov_report" / "govreport-00.txt"


def rtn_checkpoint(src: Path, dst: Path, group: int) -> None:
    """Round-to-nearest AWQ GEMM checkpoint of every decoder linear (lm_head stays fp)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hisparse_cli.kernels.int4.awq_pack import quantize_weight

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name in [k[:-7] for k in tensors if k.endswith("_proj.weight")]:
        p = quantize_weight(tensors.pop(name + ".weight").float(), group)
        tensors.update({f"{name}.qweight": p.qweight, f"{name}.qzeros": p.qzeros,
                        f"{name}.scales": p.scales})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                  "zero_point": True, "version": "gemm"}
    (dst / "config.json").write_text(json.dumps(cfg))


def child(model_dir: str, ids_file: str, new_tokens: int) -> None:
    import resource

    from hisparse_cli.engine import Engine, SparseConfig
    from hisparse_cli.kernels.dispatch import select_backend

    ids = json.loads(Path(ids_file).read_text())
    eng = Engine.from_pretrained(model_dir, sparse=SparseConfig())
    res = eng.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    s = res.stats
    print(json.dumps(dict(tokens=res.token_ids, prefill_s=s.prefill_seconds,
                          decode_s=s.decode_seconds,
                          decode_ms_per_token=1e3 * s.decode_seconds / max(1, s.new_tokens),
                          int4_linear=select_backend("cpu").int4_linear,
                          peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                          * 1024)))


def fidelity(a) -> None:
    """Teacher-forced, one token a step: the packed decode path against the exact reference
    on the same INT4 weights (the backend is read per call: HISPARSE_BACKEND switches it),
    and the fp32 model for scale."""
    import torch
    from transformers import AutoTokenizer

    from hisparse_cli.engine import Engine, SparseConfig
    from hisparse_cli.quality.capture import logits_at, teacher_forced
    from hisparse_cli.quality.metrics import token_fidelity
    from hisparse_cli.hub.resolve import resolve_model

    model = a.model or str(resolve_model("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    ids = tok(Path(a.doc).read_text(encoding="utf-8"))["input_ids"][: a.fidelity + 1]
    sparse = SparseConfig(prefill_chunk=1)
    targets = torch.tensor(ids[1:])
    with tempfile.TemporaryDirectory() as tmp:
        awq = a.awq or str(Path(tmp) / "awq")
        if a.awq is None:
            rtn_checkpoint(Path(model), Path(awq), 64)
        os.environ.pop("HISPARSE_BACKEND", None)
        eng4 = Engine.from_pretrained(awq, sparse=sparse)
        logits = {}
        for label, backend in (("INT4 packed", "auto"), ("INT4 reference", "torch")):
            os.environ["HISPARSE_BACKEND"] = backend
            tr = teacher_forced(eng4, ids[:-1], sparse)
            logits[label] = logits_at(eng4, tr.hidden)
            print(f"{label:<15} {tr.seconds:7.1f} s for {len(ids) - 1} one-token steps",
                  flush=True)
        os.environ.pop("HISPARSE_BACKEND", None)
        eng = Engine.from_pretrained(model, sparse=sparse)
        tr = teacher_forced(eng, ids[:-1], sparse)
        logits["fp32"] = logits_at(eng, tr.hidden)
    res = {}
    for ref, other in (("INT4 reference", "INT4 packed"), ("fp32", "INT4 reference"),
                       ("fp32", "INT4 packed")):
        f = token_fidelity(logits[ref], logits[other], targets)
        res[f"{other} vs {ref}"] = dict(kl=f.kl / f.n, top1=f.agree / f.n,
                                        ppl_ref=float(torch.exp(torch.tensor(f.nll_dense / f.n))),
                                        ppl=float(torch.exp(torch.tensor(f.nll_sparse / f.n))))
        r = res[f"{other} vs {ref}"]
        print(f"{other} vs {ref}: KL {r['kl']:.5f} nats/token, top-1 agreement "
              f"{r['top1']:.4f}, perplexity {r['ppl']:.3f} vs {r['ppl_ref']:.3f} "
              f"({f.n} tokens)", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(dict(tokens=len(ids) - 1, results=res), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--awq", default=None, help="an AWQ checkpoint of --model (default: RTN)")
    ap.add_argument("--doc", default=str(DEFAULT_DOC))
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--fidelity", type=int, default=0, metavar="N",
                    help="instead: N tokens of --doc teacher-forced one token a step (every "
                         "linear call decode-sized) through the INT4 model with the packed "
                         "kernel and with the exact reference, and through the fp32 model: "
                         "KL, top-1 agreement and perplexity")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], int(a.child[2]))
        return
    if a.fidelity:
        fidelity(a)
        return
    from cpu_engine_vs_hf import prompt_ids

    from hisparse_cli.hub.resolve import resolve_model

    model = a.model or str(resolve_model("smollm2-135m-instruct"))
    ids = prompt_ids(model, a.doc, a.prompt_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        awq = a.awq
        if awq is None:
            awq = str(Path(tmp) / "awq")
            rtn_checkpoint(Path(model), Path(awq), 64)
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(ids))
        variants = [("fp32 weights", model, {}), ("INT4, packed decode", awq, {}),
                    ("INT4, fp32 reference", awq, {"HISPARSE_BACKEND": "torch"})]
        rows = []
        for r in range(a.rounds):
            order = variants[r % 3:] + variants[:r % 3]
            for label, path, env in order:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", path, str(ids_file),
                     str(a.new_tokens)], env={**os.environ, **env},
                    capture_output=True, text=True, check=True)
                row = dict(json.loads(out.stdout.strip().splitlines()[-1]), variant=label,
                           round=r)
                rows.append(row)
                print(f"round {r} {label:<22} prefill {row['prefill_s']:6.2f} s  decode "
                      f"{row['decode_ms_per_token']:7.1f} ms/token  RSS "
                      f"{row['peak_rss_bytes'] / 2**20:6.0f} MiB  ({row['int4_linear']})",
                      flush=True)
    ref = {r["round"]: r["tokens"] for r in rows if r["variant"] == "INT4, fp32 reference"}
    for r in rows:
        if r["variant"] == "INT4, packed decode":
            same = sum(x == y for x, y in zip(r["tokens"], ref[r["round"]]))
            first = next((i for i, (x, y) in enumerate(zip(r["tokens"], ref[r["round"]]))
                          if x != y), None)
            print(f"round {r['round']}: packed decode tokens equal to the reference path's in "
                  f"{same}/{len(r['tokens'])} positions (first difference: {first})")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(dict(prompt_tokens=len(ids), rows=rows), indent=1))


if __name__ == "__main__":
    main()
