"""AWQ INT4 on the CPU: decode speed through torch's packed int4 kernel (`decode`), its fidelity
to the exact reference (`fidelity`), and quantization quality by perplexity (`perplexity`).

    python benchmarks/cpu_awq.py decode [--model DIR] [--awq DIR] [--doc FILE]
        [--prompt-tokens 2000] [--new-tokens 64] [--rounds 2] [--json OUT.json]
    python benchmarks/cpu_awq.py fidelity [--tokens 400] [--model DIR] [--awq DIR] [--doc FILE]
        [--json OUT.json]
    python benchmarks/cpu_awq.py perplexity [--model DIR] [--group-size 64] [--head]
        [--json OUT.json]
    python benchmarks/cpu_awq.py w4a8 [--block 128] [--json OUT.json]
    python benchmarks/cpu_awq.py w4a8-cli --variant w4a8|w4a16 -- batch @DOCS --model AWQ_DIR
        --out RESULTS.jsonl

decode: an AWQ INT4 model through the engine with the packed int4 decode path
(kernels/int4/awq_cpu.py, the CPU default) against the exact fp32 reference path
(HISPARSE_BACKEND=torch) and the unquantized fp32 model, same prompt, greedy, in one run.
The INT4 checkpoint is round-to-nearest (group 64) of the model's own weights, written once
to a temporary folder (`hisparse quantize` output can be passed with --awq instead). Each
variant runs in its own subprocess (the backend is chosen per process; peak RSS per
variant), rounds alternate the order.

fidelity: N tokens of --doc teacher-forced one token a step (every linear call decode-sized)
through the INT4 model with the packed kernel and with the exact reference, and through the
fp32 model: KL, top-1 agreement and perplexity.

Default model of decode and fidelity: the embedded SmolLM2-135M (hisparse models path
smollm2-135m-instruct).

perplexity: held-out perplexity of a model in fp32, INT4 round-to-nearest and INT4 AWQ (same
group size). Calibration: the first 75% of every samples/ document; held out: the remaining
25% (split at a line break). Both INT4 folders are written by `quantize_model` (method rtn /
awq) and loaded back through our loader, so the numbers include packing, export and the INT4
linear. --head adds the output head's rows: AWQ with `quantize_lm_head` (the activation-aware
head of `hisparse quantize --quantize-lm-head`), and the AWQ body with its head rounded to
nearest (awq_pack.fake_quantize, at the group size and at 32) in place of the fp head, and
the INT8 head (model/int8_linear.py, the small-card profiles' `lm_head_format = "int8"`) on
the fp32 and the AWQ bodies, with its teacher-forced KL against the fp head of each.
Default model: the embedded SmolLM2-135M (resolve_model(None)), falling back to /tmp/smollm2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
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
    ids = tok(Path(a.doc).read_text(encoding="utf-8"))["input_ids"][: a.tokens + 1]
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


def decode(a) -> None:
    """`decode`: the three variants, each in its own process, rounds rotating the order."""
    if a.child:
        child(a.child[0], a.child[1], int(a.child[2]))
        return
    from cpu_engine_vs_hf import prompt_ids

    from hisparse_cli.hub.resolve import resolve_model

    model = a.model or str(resolve_model("smollm2-135m-instruct"))
    ids = prompt_ids(model, a.doc, a.prompt_tokens, anchor=False, new=a.new_tokens)
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
                    [sys.executable, __file__, "decode", "--child", path, str(ids_file),
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


# -- perplexity ------------------------------------------------------------------------------------
def default_model() -> Path:
    try:
        from hisparse_cli.hub.resolve import resolve_model

        return resolve_model(None, auto_pull=False)
    except Exception as exc:  # not pulled yet: the folder built by hand for experiments
        print(f"resolve_model(None) failed ({exc}); using /tmp/smollm2", file=sys.stderr)
        return Path("/tmp/smollm2")


def swap_int8_head(model, windows) -> dict:
    """Replace model.lm_head by its INT8 copy (hisparse_cli/model/int8_linear.py), in place;
    the teacher-forced KL(fp head || INT8 head) and top-1 agreement over the windows."""
    import torch

    from hisparse_cli.model.int8_linear import Int8Linear
    from hisparse_cli.model.llama import forward_full

    fp_head = model.lm_head
    int8_head = Int8Linear.from_float(fp_head.weight)
    kl, agree, n = 0.0, 0, 0
    for ids in windows:
        model.lm_head = fp_head
        p = torch.log_softmax(forward_full(model, ids).float(), -1)
        model.lm_head = int8_head
        q = torch.log_softmax(forward_full(model, ids).float(), -1)
        kl += float((p.exp() * (p - q)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        n += ids.numel()
    return {"kl": kl / n, "top1": agree / n, "tokens": n}


def perplexity_rows(model_dir: Path, group_size: int, seq_len: int, samples: int, work: Path,
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
    head_fidelity = {}
    if head:  # the INT8 head (profiles' lm_head_format = "int8") on the fp32 body
        head_fidelity["fp32+int8-head vs fp32"] = swap_int8_head(fp, windows)
        rows["fp32+int8-head"] = perplexity(fp, windows)
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
            head_fidelity["int4-awq+int8-head vs int4-awq"] = swap_int8_head(q, windows)
            rows["int4-awq+int8-head"] = perplexity(q, windows)
            q.lm_head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
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
        "head_fidelity": head_fidelity,
        "awq_calib_loss_ratio": reports["awq"].loss_ratio,
        "size_bytes": {m: r.size_bytes for m, r in reports.items()},
        "quantize_seconds": {m: r.seconds for m, r in reports.items()},
    }
    return result


def perplexity(args) -> None:
    """`perplexity`: fp32, INT4 round-to-nearest and INT4 AWQ on held-out text."""
    model_dir = args.model or default_model()
    with tempfile.TemporaryDirectory() as tmp:
        res = perplexity_rows(model_dir, args.group_size, args.seq_len, args.samples, Path(tmp),
                              args.head)
    print(f"model {res['model']}  group {res['group_size']}  calib {res['calib_tokens']} tokens "
          f"({res['calib_blocks']} blocks)  held-out {res['heldout_tokens']} tokens")
    print(f"{'weights':<22} {'perplexity':>10} {'vs fp32':>9}")
    for k, v in res["perplexity"].items():
        print(f"{k:<22} {v:>10.3f} {res['increase_over_fp_pct'][k]:>+8.2f}%")
    for k, v in res["head_fidelity"].items():
        print(f"{k}: KL {v['kl']:.6f} nats/token, top-1 agreement {100 * v['top1']:.2f} % "
              f"({v['tokens']} tokens)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


def w4a8(args) -> None:
    """`w4a8`: the W4A8 prefill product's activation rounding (kernels/fp8/w4a8_ref.py), emulated
    in fp32 on the CPU: every AWQ linear of the INT4 model computes x @ W with x in fp16 (the
    W4A16 peer), or with x rounded to e4m3 in blocks of --block inputs per token (W4A8; the
    weight's INT4 values exact), or per token (one block of K), or with the weight also rounded
    to e4m3 per output column (the lossy alternative). Teacher-forced over windows of real
    documents: KL(W4A16 || variant) in nats/token, top-1 agreement, perplexity of each."""
    import glob
    import math

    import torch
    from transformers import AutoTokenizer

    from hisparse_cli.kernels.fp8.w4a8_ref import E4M3, w4a8_linear_ref
    from hisparse_cli.kernels.int4.awq_layout import kmajor_to_awq
    from hisparse_cli.kernels.int4.awq_ref import dequantize_weight
    from hisparse_cli.model.awq import AWQLinear
    from hisparse_cli.model.llama import forward_full
    from hisparse_cli.model.loader import load_model
    from hisparse_cli.quantize.api import quantize_model
    from hisparse_cli.quantize.calibration import default_calibration_texts
    from hisparse_cli.quantize.evaluate import split_texts

    torch.manual_seed(0)
    model_dir = args.model or default_model()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    docs = sorted(p for p in glob.glob(str(Path(args.docs) / "*" / "*.txt"))
                  if not p.endswith(".ref.txt"))
    windows = []
    for path in docs[::args.doc_stride]:  # a window from inside each document
        ids = tok(Path(path).read_text()[:40000])["input_ids"]
        if len(ids) >= args.skip + args.seq_len:
            windows.append(torch.tensor(ids[args.skip:args.skip + args.seq_len]))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "awq"
        calib, _ = split_texts(default_calibration_texts())
        quantize_model(model_dir, work, calib_texts=calib, group_size=args.group_size,
                       n_samples=128, seq_len=512, method="awq")
        q, _ = load_model(work, "cpu", torch.float32)
    named = [(n, m) for n, m in q.named_modules() if isinstance(m, AWQLinear)]
    lins = [m for _, m in named]
    keep = {i for i, (n, _) in enumerate(named)  # --keep: these stay W4A16 in every row
            if any(n.endswith(k) for k in args.keep)}
    weights = [dequantize_weight(m.qweight if m.layout == "awq" else kmajor_to_awq(m.qweight),
                                 m.qzeros, m.scales, m.group_size) for m in lins]

    def w8_columns(w):  # e4m3 weight, one scale per output column (lossy)
        sc = w.abs().amax(0, keepdim=True).clamp_min(1e-12) / 448.0
        return (w / sc).to(E4M3).float() * sc

    variants = {
        "w4a16": lambda x, w: x.half().float() @ w.half().float(),
        f"w4a8 (1x{args.block} blocks)": lambda x, w: w4a8_linear_ref(
            x.half(), w.half().float(), block=args.block).float(),
        "w4a8 (per token)": lambda x, w: w4a8_linear_ref(
            x.half(), w.half().float(), block=x.shape[-1]).float(),
        "w8a8 (per token, e4m3 weight per column)": lambda x, w: w4a8_linear_ref(
            x.half(), w8_columns(w.half().float()), block=x.shape[-1]).float(),
    }

    def run(fn):
        for i, (m, w) in enumerate(zip(lins, weights)):
            f = variants["w4a16"] if i in keep else fn

            def fwd(x, w=w, b=m.bias, f=f):
                y = f(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])
                return (y + b.float() if b is not None else y).to(x.dtype)
            m.forward = fwd
        with torch.inference_mode():
            return [torch.log_softmax(forward_full(q, ids).float(), -1) for ids in windows]

    base = run(variants["w4a16"])
    tokens = sum(ids.numel() for ids in windows)

    def ppl(outs):
        nll = sum(float(-o[:-1].gather(1, ids[1:, None]).sum()) for o, ids in zip(outs, windows))
        return math.exp(nll / sum(ids.numel() - 1 for ids in windows))

    res = {"model": str(model_dir), "group_size": args.group_size, "block": args.block,
           "kept_w4a16": list(args.keep),
           "windows": len(windows), "tokens": tokens, "seq_len": args.seq_len,
           "rows": {"w4a16": {"perplexity": ppl(base)}}}
    for name, fn in list(variants.items())[1:]:
        outs = run(fn)
        kls = [float((p.exp() * (p - r)).sum(-1).mean()) for p, r in zip(base, outs)]
        res["rows"][name] = {
            "kl_vs_w4a16": sum(float((p.exp() * (p - r)).sum()) for p, r in zip(base, outs))
            / tokens,
            "kl_per_window": kls,
            "top1_vs_w4a16": sum(int((p.argmax(-1) == r.argmax(-1)).sum())
                                 for p, r in zip(base, outs)) / tokens,
            "perplexity": ppl(outs)}
    print(f"model {res['model']}  group {args.group_size}  {len(windows)} windows x "
          f"{args.seq_len} tokens ({tokens} tokens)")
    print(f"{'activations':<42} {'KL vs W4A16':>12} {'top-1':>7} {'perplexity':>10}")
    for name, r in res["rows"].items():
        print(f"{name:<42} {r.get('kl_vs_w4a16', 0.0):>12.5f} "
              f"{100 * r.get('top1_vs_w4a16', 1.0):>6.2f}% {r['perplexity']:>10.3f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


def w4a8_cli(args) -> None:
    """`w4a8-cli`: run the hisparse CLI in this process with every AWQ linear of the loaded
    model computing through the W4A8 emulation (--variant w4a8: prefill-sized calls round
    their activations to e4m3 in 1x--block blocks; decode-sized calls, as on the GPU, keep
    fp16 activations) or through the W4A16 one (--variant w4a16: fp16 activations throughout),
    the weight's INT4 values exact in both. The peer for ROUGE: the same command with the
    other variant, scored by quality_pipeline.py --no-run --extra NAME=FILE."""
    import torch

    from hisparse_cli.cli.app import main as cli_main
    from hisparse_cli.kernels.fp8.w4a8_ref import w4a8_linear_ref
    from hisparse_cli.kernels.int4.awq_layout import GEMV_MAX_TOKENS, kmajor_to_awq
    from hisparse_cli.kernels.int4.awq_ref import dequantize_weight
    from hisparse_cli.model.awq import AWQLinear

    cache: dict = {}

    def forward(self, x):
        w = cache.get(id(self))
        if w is None:
            qw = self.qweight if self.layout == "awq" else kmajor_to_awq(self.qweight)
            w = cache[id(self)] = dequantize_weight(qw, self.qzeros, self.scales,
                                                    self.group_size).half().float()
        x2 = x.reshape(-1, x.shape[-1]).half()
        if args.variant == "w4a8" and x2.shape[0] > GEMV_MAX_TOKENS:
            y = w4a8_linear_ref(x2, w, block=args.block).float()
        else:
            y = x2.float() @ w
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[1])

    AWQLinear.forward = forward
    torch.manual_seed(0)
    sys.argv = ["hisparse", *args.cli]
    cli_main()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, helptext in (("decode", "INT4 decode speed: packed kernel vs exact reference vs "
                            "fp32 weights"),
                           ("fidelity", "the packed kernel's logits against the exact "
                            "reference's, teacher-forced")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", default=None)
        p.add_argument("--awq", default=None, help="an AWQ checkpoint of --model (default: RTN)")
        p.add_argument("--doc", default=str(DEFAULT_DOC))
        p.add_argument("--json", default=None)
        p.set_defaults(run=decode if name == "decode" else fidelity)
        if name == "decode":
            p.add_argument("--prompt-tokens", type=int, default=2000)
            p.add_argument("--new-tokens", type=int, default=64)
            p.add_argument("--rounds", type=int, default=2)
            p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
        else:
            p.add_argument("--tokens", "--fidelity", type=int, default=400, metavar="N",
                           help="tokens of --doc teacher-forced one token a step")
    p = sub.add_parser("perplexity", help="held-out perplexity: fp32 vs INT4 round-to-nearest "
                       "vs INT4 AWQ")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--head", action="store_true", help="also the INT4 output head rows")
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(run=perplexity)
    p = sub.add_parser("w4a8", help="FP8 activations (W4A8) against W4A16, teacher-forced")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--docs", default=str(ROOT.parent / "shared" / "eval_dev"),
                   help="a folder of <kind>/<name>.txt documents (.ref.txt skipped)")
    p.add_argument("--doc-stride", type=int, default=2, help="every Nth document")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--block", type=int, default=128,
                   help="activation inputs per scale (a K not a multiple ends in a shorter one)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--skip", type=int, default=1000, help="tokens skipped at each start")
    p.add_argument("--keep", nargs="*", default=[],
                   help="linears (name suffixes, e.g. down_proj) that keep fp16 activations")
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(run=w4a8)
    p = sub.add_parser("w4a8-cli", help="the CLI with the W4A8 or W4A16 emulation (ROUGE)")
    p.add_argument("--variant", choices=("w4a8", "w4a16"), required=True)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("cli", nargs=argparse.REMAINDER, help="hisparse's arguments (after --)")
    p.set_defaults(run=w4a8_cli)
    a = ap.parse_args()
    if getattr(a, "cli", None) and a.cli[0] == "--":
        a.cli = a.cli[1:]
    a.run(a)


if __name__ == "__main__":
    main()
