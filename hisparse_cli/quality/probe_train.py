"""Training the importance probe by distillation from the model's own attention.

    module, meta = train_probe(engine, texts, ProbeTrainConfig())
    save_probe(module, "hisparse_cli/probes/smollm2-135m.safetensors", meta)

Data: the texts are joined and cut into pieces of `max_tokens`; each piece runs once through
the model (dense causal attention, our forward pass). At every layer we keep
  * x_l[j]: the normed hidden state the layer's `ctx.observe` sees (the probe's input), and
  * the target: the attention token j receives while it is in the window — per KV head, the
    windowed softmax (sinks ∪ last `window` keys: what a sparse run computes) summed over
    the KV head's query heads, times the number of visible keys (1.0 = uniform attention,
    so early and late queries weigh alike), averaged over the queries whose window holds j;
    regressed in log space. Sinks and tokens seen by fewer than window/4 queries are skipped.
Fit: Adam on mean squared error, a random 10% of rows held out; the sidecar records the
Pearson and Spearman correlation of predictions with targets per layer (train and held-out).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from hisparse_cli.quality.probe import ImportanceProbe, fingerprint

TEXT_SUFFIXES = (".txt", ".md", ".py", ".toml", ".rst")


@dataclass(frozen=True)
class ProbeTrainConfig:
    window: int = 512
    sinks: int = 4
    max_tokens: int = 2048  # tokens per training piece
    rows_per_piece: int = 1024  # sampled tokens per piece and layer
    epochs: int = 40
    batch: int = 2048
    lr: float = 1e-2
    seed: int = 0
    rank: int | None = None


def read_texts(paths: list[str | Path]) -> list[tuple[str, str]]:
    """(name, text) of files, and of every text-like file below folders, sorted.

    A file given by name is read as `summarize` reads a document (documents.load_document:
    PDF or text, InputError when missing, binary, empty or unreadable). Below a folder, the
    TEXT_SUFFIXES files are decoded like text documents; binary, empty and unreadable ones
    are skipped."""
    from hisparse_cli.documents import load_document
    from hisparse_cli.documents.text import SNIFF_BYTES, decode_bytes, looks_binary
    from hisparse_cli.errors import InputError

    out = []
    for p in map(Path, paths):
        if not p.is_dir():
            out.append((str(p), load_document(p).text))
            continue
        for f in sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES):
            try:
                data = f.read_bytes()
                text = "" if looks_binary(data[:SNIFF_BYTES]) else decode_bytes(data)[0]
            except (OSError, InputError):
                continue
            if text.strip():
                out.append((str(f), text))
    return out


class _TargetContext:
    """Dense causal attention for the forward pass; records x and the window-mass targets."""

    def __init__(self, n: int, cfg: ProbeTrainConfig, hkv: int) -> None:
        self.n, self.cfg, self.hkv = n, cfg, hkv
        self.wants_hidden = True
        self.x: dict[int, torch.Tensor] = {}
        self.target: dict[int, torch.Tensor] = {}

    def observe(self, layer: int, x: torch.Tensor) -> None:
        self.x[layer] = x.float().cpu()

    def attend(self, layer, q, k, v):
        t, hq, d = q.shape
        grp = hq // k.shape[1]
        kk = k.repeat_interleave(grp, dim=1).transpose(0, 1).float()  # [Hq, T, D]
        vv = v.repeat_interleave(grp, dim=1).transpose(0, 1).float()
        qq = q.transpose(0, 1).float()
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        self.target[layer] = self._window_mass(qq, kk, grp)
        return out.transpose(0, 1).to(q.dtype)

    def _window_mass(self, qq, kk, grp, block: int = 256) -> torch.Tensor:
        hq, t, d = qq.shape
        w, sinks = self.cfg.window, self.cfg.sinks
        mass = torch.zeros(hq, t)
        kpos = torch.arange(t)
        for s in range(0, t, block):
            qpos = torch.arange(s, min(s + block, t))
            vis = (kpos[None] <= qpos[:, None]) & ((kpos[None] < sinks) | (kpos[None] > qpos[:, None] - w))
            scores = torch.einsum("hqd,hkd->hqk", qq[:, qpos], kk) * d ** -0.5
            p = torch.softmax(scores.masked_fill(~vis, float("-inf")), dim=-1)
            in_win = vis & (kpos[None] >= sinks)
            mass += (p * vis.sum(-1, keepdim=True) * in_win).sum(1).cpu()
        seen = (torch.clamp(torch.arange(t, 0, -1), max=w)).float()  # queries whose window holds j
        mean = mass.view(self.hkv, grp, t).mean(1) / seen  # [Hkv, T]
        return mean.transpose(0, 1)  # [T, Hkv]


def collect_probe_data(engine, texts: list[tuple[str, str]], cfg: ProbeTrainConfig,
                       progress: Callable[[str], None] | None = None):
    """(layer [N] int64, x [N, hidden], y [N, Hkv] log-mass, piece names)."""
    tok = engine.tokenizer
    ids = []
    for _, text in texts:
        ids += tok(text.strip() + "\n\n", add_special_tokens=False)["input_ids"]
    pieces = [ids[s:s + cfg.max_tokens] for s in range(0, len(ids), cfg.max_tokens)]
    pieces = [p for p in pieces if len(p) >= cfg.window]
    gen = torch.Generator().manual_seed(cfg.seed)
    L, H = engine.cfg.num_hidden_layers, engine.cfg.num_key_value_heads
    layers, xs, ys = [], [], []
    for i, piece in enumerate(pieces):
        if progress:
            progress(f"piece {i + 1}/{len(pieces)} ({len(piece)} tokens)")
        n = len(piece)
        ctx = _TargetContext(n, cfg, H)
        x = torch.tensor(piece, dtype=torch.int64, device=engine.device)
        with torch.inference_mode():
            engine.model(x, torch.arange(n, device=engine.device), ctx, all_logits=False)
        seen = torch.clamp(torch.arange(n, 0, -1), max=cfg.window)
        ok = torch.nonzero((torch.arange(n) >= cfg.sinks) & (seen >= cfg.window // 4)).flatten()
        for layer in range(L):
            pick = ok[torch.randperm(ok.numel(), generator=gen)[:cfg.rows_per_piece]]
            layers.append(torch.full((pick.numel(),), layer, dtype=torch.int64))
            xs.append(ctx.x[layer][pick])
            ys.append(torch.log(ctx.target[layer][pick].clamp(min=1e-6)))
    if not xs:
        from hisparse_cli.errors import InputError

        raise InputError(f"training texts are too short: need pieces of at least {cfg.window} tokens",
                         hint="give longer --texts or a smaller --window")
    return torch.cat(layers), torch.cat(xs), torch.cat(ys), len(pieces)


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = torch.argsort(torch.argsort(a)).float()
    rb = torch.argsort(torch.argsort(b)).float()
    return _pearson(ra, rb)


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = float(a.norm() * b.norm())
    return float((a * b).sum()) / den if den > 0 else float("nan")


def correlations(module, layer, x, y) -> dict:
    """Mean over layers and KV heads of Pearson/Spearman(prediction, target)."""
    with torch.no_grad():
        pred = module(layer, x)
    pear, spear = [], []
    for lyr in torch.unique(layer).tolist():
        m = layer == lyr
        for h in range(y.shape[1]):
            if int(m.sum()) > 2:
                pear.append(_pearson(pred[m, h], y[m, h]))
                spear.append(_spearman(pred[m, h], y[m, h]))
    clean = [v for v in pear if not math.isnan(v)], [v for v in spear if not math.isnan(v)]
    return {"pearson": sum(clean[0]) / max(len(clean[0]), 1),
            "spearman": sum(clean[1]) / max(len(clean[1]), 1), "rows": int(layer.numel())}


def fit_probe(layer, x, y, num_layers: int, num_kv_heads: int, cfg: ProbeTrainConfig):
    """Train an ImportanceProbe on (layer, x, y); returns (module, fit metrics)."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    perm = torch.randperm(layer.numel(), generator=gen)
    n_val = max(1, layer.numel() // 10)
    val, tr = perm[:n_val], perm[n_val:]
    module = ImportanceProbe(x.shape[1], num_layers, num_kv_heads, cfg.rank)
    with torch.no_grad():  # start at each layer/head's mean target
        for lyr in range(num_layers):
            m = layer[tr] == lyr
            if m.any():
                module.out_b[lyr] = y[tr][m].mean(0)
    opt = torch.optim.Adam(module.parameters(), lr=cfg.lr)
    steps = cfg.epochs * max(1, math.ceil(tr.numel() / cfg.batch))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(cfg.epochs):
        order = tr[torch.randperm(tr.numel(), generator=gen)]
        for s in range(0, order.numel(), cfg.batch):
            b = order[s:s + cfg.batch]
            loss = F.mse_loss(module(layer[b], x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    module.eval()
    with torch.no_grad():
        mse = {"train": float(F.mse_loss(module(layer[tr], x[tr]), y[tr])),
               "heldout": float(F.mse_loss(module(layer[val], x[val]), y[val]))}
    return module, {"mse": mse, "train": correlations(module, layer[tr], x[tr], y[tr]),
                    "heldout": correlations(module, layer[val], x[val], y[val])}


def train_probe(engine, texts: list[tuple[str, str]], cfg: ProbeTrainConfig | None = None,
                progress: Callable[[str], None] | None = None, model_name: str = ""):
    """Collect targets from `engine`'s model on `texts`, fit, and return (module, meta)."""
    cfg = cfg or ProbeTrainConfig()
    started = time.perf_counter()
    layer, x, y, pieces = collect_probe_data(engine, texts, cfg, progress)
    if progress:
        progress(f"fitting on {layer.numel()} rows")
    module, fit = fit_probe(layer, x, y, engine.cfg.num_hidden_layers,
                            engine.cfg.num_key_value_heads, cfg)
    meta = {"model": fingerprint(engine.cfg), "model_name": model_name,
            "target": "log mean windowed attention mass (x visible keys) per KV head",
            "train_config": asdict(cfg), "texts": [name for name, _ in texts],
            "pieces": pieces, "fit": fit, "seconds": time.perf_counter() - started,
            "date": time.strftime("%Y-%m-%d")}
    return module, meta


__all__ = ["ProbeTrainConfig", "train_probe", "collect_probe_data", "fit_probe", "read_texts",
           "correlations"]
