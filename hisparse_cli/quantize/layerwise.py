"""Layer-by-layer AWQ over a Llama-family decoder (our `CausalLM`, or HF's: same names).

1. `capture_layer_inputs`: run the model's own forward on each calibration sequence and stop at
   decoder layer 0 (a forward pre-hook that raises), keeping its positional/keyword inputs.
2. `quantize_layer` for each layer in turn: forward every sequence through the fp layer with
   pre-hooks on its linears (per-channel mean |x| over all tokens, plus a fixed subsample of
   token rows for the searches); the fp outputs become the next layer's inputs. Then search and
   fold the scales (into the RMSNorm weights / the previous linear's rows), search clipping
   ranges, and pack all seven linears. The layer keeps its scaled fp weights (norms included),
   which is what the exporter writes for the fp tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hisparse_cli.kernels.int4.awq_pack import PackedInt4, quantize_weight
from hisparse_cli.quantize.search import (gated_mlp_loss, linear_outputs_loss, search_clip,
                                          search_scale)

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")  # q.k products amplify clipping error
TAPS = {"attn_in": "self_attn.q_proj", "o_in": "self_attn.o_proj",
        "mlp_in": "mlp.gate_proj", "down_in": "mlp.down_proj"}  # input features we record


@dataclass(frozen=True)
class SearchSettings:
    group_size: int = 128
    awq: bool = True  # False: plain round-to-nearest (the baseline), no search
    n_grid: int = 20
    search_tokens: int = 4096  # token rows kept for the searches (Gram-based objectives)
    mlp_tokens: int = 4096  # of those, rows for the MLP-output objective (the costly one)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32  # the layer's compute dtype during calibration


@dataclass(frozen=True)
class GroupResult:
    """One scaled group of one layer: objective with RTN vs with the chosen scales."""

    layer: int
    group: str  # "attn_in" | "o_in" | "mlp_in" | "down_in"
    alpha: float | None
    rtn_loss: float
    awq_loss: float


class _Stop(Exception):
    pass


def _to(obj, device, dtype=None):
    """Move the tensors inside nested args/kwargs; float tensors also to dtype when given."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, dtype) if dtype is not None and obj.is_floating_point() \
            else obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device, dtype) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device, dtype) for k, v in obj.items()}
    return obj


@torch.no_grad()
def capture_layer_inputs(layers: nn.ModuleList, forward_fn: Callable[[torch.Tensor], object],
                         sequences: list[torch.Tensor]) -> list[tuple[tuple, dict]]:
    """(args, kwargs) that decoder layer 0 receives for each sequence of token ids."""
    caught: list[tuple[tuple, dict]] = []

    def hook(_module, args, kwargs):
        caught.append((args, kwargs))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in sequences:
            try:
                forward_fn(ids)
            except _Stop:
                pass
    finally:
        handle.remove()
    return caught


def _hidden(call: tuple[tuple, dict]) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(call: tuple[tuple, dict], x: torch.Tensor) -> tuple[tuple, dict]:
    args, kwargs = call
    if args:
        return (x,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


class _Recorder:
    """Forward pre-hook: running mean |x| per input channel, plus a row subsample."""

    def __init__(self, rows_per_call: int) -> None:
        self.rows_per_call = rows_per_call
        self.abs_sum: torch.Tensor | None = None
        self.count = 0
        self.rows: list[torch.Tensor] = []

    def __call__(self, _module, args) -> None:
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # [T, in]
        s = x.abs().sum(0)
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        self.count += x.shape[0]
        idx = torch.linspace(0, x.shape[0] - 1, min(self.rows_per_call, x.shape[0]),
                             device=x.device).round().long()
        self.rows.append(x[idx])

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.abs_sum / max(1, self.count), torch.cat(self.rows, 0)  # [in], [S, in]


def _fold(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Exact rewrite: prev's output channels / s, each linear's input columns * s."""
    s = s.to(prev.weight.device)
    prev.weight.data = (prev.weight.data.float() / s.view(-1, *[1] * (prev.weight.dim() - 1))
                        ).to(prev.weight.dtype)
    if getattr(prev, "bias", None) is not None:
        prev.bias.data = (prev.bias.data.float() / s).to(prev.bias.dtype)
    for lin in linears:
        lin.weight.data = (lin.weight.data.float() * s.view(1, -1)).to(lin.weight.dtype)


@torch.no_grad()
def quantize_layer(index: int, layer: nn.Module, calls: list[tuple[tuple, dict]],
                   st: SearchSettings) -> tuple[list[tuple[tuple, dict]], dict[str, PackedInt4],
                                                list[GroupResult]]:
    """AWQ one decoder layer in place. Returns (next layer's calls, packed linears, results)."""
    store_device = next(layer.parameters()).device
    store_dtype = next(layer.parameters()).dtype
    layer.to(st.device, st.dtype)
    mods = {name: layer.get_submodule(name) for name in LINEARS}
    rows = max(1, -(-st.search_tokens // max(1, len(calls))))
    recorders = {tap: _Recorder(rows) for tap in TAPS}
    handles = [mods[TAPS[tap]].register_forward_pre_hook(rec) for tap, rec in recorders.items()]
    next_calls = []
    try:
        for call in calls:
            call = _to(call, st.device, st.dtype)
            out = layer(*call[0], **call[1])
            out = out[0] if isinstance(out, tuple) else out
            next_calls.append(_with_hidden(call, out))
    finally:
        for h in handles:
            h.remove()
    feats = {tap: rec.result() for tap, rec in recorders.items()}  # tap -> (mean|x|, rows)
    results: list[GroupResult] = []
    g = st.group_size
    if st.awq:
        w = {name: m.weight.data.float() for name, m in mods.items()}
        attn, mlp = layer.self_attn, layer.mlp
        groups = [("attn_in", layer.input_layernorm, ["self_attn.q_proj", "self_attn.k_proj",
                                                      "self_attn.v_proj"])]
        if mods["self_attn.v_proj"].out_features == mods["self_attn.o_proj"].in_features:
            groups.append(("o_in", attn.v_proj, ["self_attn.o_proj"]))  # not with GQA
        groups += [("mlp_in", layer.post_attention_layernorm, ["mlp.gate_proj", "mlp.up_proj"]),
                   ("down_in", mlp.up_proj, ["mlp.down_proj"])]
        for tap, prev, names in groups:
            x_mean, x = feats[tap]
            ws = [w[n] for n in names]
            if tap == "mlp_in":
                xm = x[:: max(1, x.shape[0] // st.mlp_tokens)][: st.mlp_tokens]
                loss = gated_mlp_loss(xm, ws[0], ws[1], w["mlp.down_proj"], F.silu)
            else:
                loss = linear_outputs_loss(x, ws)
            res = search_scale(x_mean, ws, g, loss, st.n_grid)
            results.append(GroupResult(index, tap, res.alpha, res.rtn_loss, res.loss))
            if res.alpha is not None:
                _fold(prev, [mods[n] for n in names], res.scales)
                feats[tap] = (x_mean / res.scales, x / res.scales)
                for n in names:
                    w[n] = mods[n].weight.data.float()
    tap_of = {"self_attn.q_proj": "attn_in", "self_attn.k_proj": "attn_in",
              "self_attn.v_proj": "attn_in", "self_attn.o_proj": "o_in",
              "mlp.gate_proj": "mlp_in", "mlp.up_proj": "mlp_in", "mlp.down_proj": "down_in"}
    packed: dict[str, PackedInt4] = {}
    for name, mod in mods.items():
        wt = mod.weight.data.float()
        lo = hi = None
        if st.awq and name not in NO_CLIP:
            lo, hi = search_clip(feats[tap_of[name]][1], wt, g, st.n_grid)
        p = quantize_weight(wt, g, lo, hi)
        packed[name] = PackedInt4(p.qweight.cpu(), p.qzeros.cpu(), p.scales.cpu(), g)
    layer.to(store_device, store_dtype)
    return next_calls, packed, results


@torch.no_grad()
def quantize_head(norm: nn.Module, head_weight: torch.Tensor, calls: list[tuple[tuple, dict]],
                  st: SearchSettings, max_tokens: int = 1024
                  ) -> tuple[PackedInt4, GroupResult | None]:
    """INT4 lm_head (tight-VRAM option) from the last layer's outputs; scales fold into `norm`.

    head_weight [vocab, hidden] is read, never modified (it may be the tied embedding table).
    """
    store = (norm.weight.device, norm.weight.dtype)
    norm.to(st.device, st.dtype)
    rec = _Recorder(max(1, -(-max_tokens // max(1, len(calls)))))
    for call in calls:
        x = norm(_to(_hidden(call), st.device, st.dtype))
        rec(None, (x,))
    x_mean, x = rec.result()
    w = head_weight.detach().to(st.device, torch.float32)
    lo = hi = None
    result = None
    if st.awq:
        res = search_scale(x_mean, [w], st.group_size, linear_outputs_loss(x, [w]), st.n_grid)
        result = GroupResult(-1, "lm_head", res.alpha, res.rtn_loss, res.loss)
        if res.alpha is not None:
            norm.weight.data = (norm.weight.data.float() / res.scales).to(norm.weight.dtype)
            w = w * res.scales
            x = x / res.scales
        lo, hi = search_clip(x, w, st.group_size, st.n_grid)
    p = quantize_weight(w, st.group_size, lo, hi)
    norm.to(*store)
    return PackedInt4(p.qweight.cpu(), p.qzeros.cpu(), p.scales.cpu(), st.group_size), result
