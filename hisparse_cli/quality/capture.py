"""Teacher-forced runs through the engine's paged/sparse path, with what the metrics need
captured on the side (no engine edits: a wrapped step context and a forward hook).

    trace = teacher_forced(engine, ids, sparse_cfg, q_positions=[...], capture_qk=True)
    trace.hidden      [T, hidden] fp32   output of the last decoder layer (pre final norm)
    trace.k[l]        [T, Hkv, D]        keys after RoPE (capture_qk)
    trace.q[l]        [S, Hq, D]         queries at q_positions (capture_qk)
    trace.globals_at  {position: [L, Hkv, G]} globals in force when that position was processed
    trace.retrieved_at {position: [L, Hkv, S*bs]} retrieval tier: the positions each layer's
                      page cache showed at that position's step (-1 = none)
    trace.window_at   {position: first window position its step attended} (retrieval tier)
    logits_at(engine, trace.hidden[rows]) -> [n, V]   the LM head, exactly as the model applies it

Only the last position's logits come out of each step; the full hidden states let callers
compute logits on the positions they score (the LM head is ~20% of a small model's FLOPs).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from hisparse_cli.config.settings import SparseConfig


class CaptureContext:
    """Wraps the engine's StepContext: records q/k per layer, then delegates."""

    def __init__(self, inner, recorder: "QKRecorder | None", on_attended=None) -> None:
        self.inner, self.recorder, self.on_attended = inner, recorder, on_attended

    @property
    def wants_hidden(self) -> bool:
        return getattr(self.inner, "wants_hidden", False)

    def observe(self, layer: int, x: torch.Tensor) -> None:
        self.inner.observe(layer, x)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.recorder is not None:
            self.recorder.record(layer, self.inner.q_start, q, k)
        out = self.inner.attend(layer, q, k, v)
        if self.on_attended is not None:
            self.on_attended(layer)
        return out


class QKRecorder:
    """Keys of every position and queries of the sampled positions, per layer."""

    def __init__(self, n_layers: int, n_tokens: int, q_positions: list[int]) -> None:
        self.n_tokens = n_tokens
        self.q_positions = sorted(set(q_positions))
        self.q_index = {p: i for i, p in enumerate(self.q_positions)}
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.q: list[torch.Tensor | None] = [None] * n_layers

    def record(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor) -> None:
        t = q.shape[0]
        if self.k[layer] is None:
            self.k[layer] = torch.zeros((self.n_tokens,) + tuple(k.shape[1:]), dtype=torch.float32)
            self.q[layer] = torch.zeros((len(self.q_positions),) + tuple(q.shape[1:]),
                                        dtype=torch.float32)
        self.k[layer][start:start + t] = k.float().cpu()
        rows = [(p - start, self.q_index[p]) for p in range(start, start + t) if p in self.q_index]
        if rows:
            src = torch.tensor([r[0] for r in rows])
            dst = torch.tensor([r[1] for r in rows])
            self.q[layer][dst] = q[src.to(q.device)].float().cpu()


@dataclass
class Trace:
    """What one teacher-forced run leaves behind (see module docstring)."""

    config: SparseConfig
    hidden: torch.Tensor
    seconds: float
    kv_bytes_peak: int
    recalibrations: int
    sinks: int
    window: int | None
    q_positions: list[int] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    globals_at: dict[int, torch.Tensor] = field(default_factory=dict)
    retrieved_at: dict[int, torch.Tensor] = field(default_factory=dict)
    window_at: dict[int, int] = field(default_factory=dict)
    offload_bytes: int = 0
    retrieval: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def engine_with(engine, sparse: SparseConfig, probe=None):
    """A view of `engine` (same weights, same tokenizer) running under `sparse`."""
    view = copy.copy(engine)
    view.sparse = sparse
    view.probe = probe if probe is not None else engine.probe
    return view


@torch.inference_mode()
def logits_at(engine, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] fp32 of last-layer hidden states [n, hidden] (final norm + LM head)."""
    m = engine.model
    h = hidden.to(device=engine.device, dtype=m.compute_dtype)
    return m.lm_head(m.model.norm(h)).float()


@torch.inference_mode()
def teacher_forced(engine, ids: list[int], sparse: SparseConfig, *, q_positions=(),
                   capture_qk: bool = False, probe=None) -> Trace:
    """Feed `ids` chunk by chunk (sparse.prefill_chunk) through a fresh run under `sparse`;
    record the last layer's hidden states, q/k (capture_qk) and the globals in force at
    each of `q_positions`."""
    eng = engine_with(engine, sparse, probe)
    model = eng.model
    n = len(ids)
    dev = eng.device
    x = torch.tensor(ids, dtype=torch.int64, device=dev)
    hidden = torch.zeros((n, eng.cfg.hidden_size), dtype=torch.float32)
    recorder = QKRecorder(eng.cfg.num_hidden_layers, n, list(q_positions)) if capture_qk else None
    want = sorted(set(int(p) for p in q_positions))
    globals_at: dict[int, torch.Tensor] = {}
    retrieved_at: dict[int, torch.Tensor] = {}
    window_at: dict[int, int] = {}
    cursor = {"start": 0, "inside": [], "run": None, "rpos": None}

    def keep_retrieved(layer: int) -> None:  # after a layer's attention, in a watched step
        tier = cursor["run"].retrieval
        if cursor["inside"] and tier is not None:
            if cursor["rpos"] is None:
                cursor["rpos"] = torch.full((eng.cfg.num_hidden_layers, tier.H, tier.S * tier.bs),
                                            -1, dtype=torch.int64)
            if tier.offloaded:
                cursor["rpos"][layer] = tier.positions(layer).cpu()

    def keep_hidden(_module, _inp, out):
        hidden[cursor["start"]:cursor["start"] + out.shape[0]] = out.float().cpu()

    def call(input_ids, positions, ctx, all_logits=False):
        wrapped = CaptureContext(ctx, recorder, keep_retrieved) if (
            recorder is not None or cursor["inside"]) else ctx
        if cursor["inside"] and ctx.window is not None:
            for p in cursor["inside"]:  # the step's first window position (retrieval tier)
                window_at[p] = ctx.q_start + ctx.n - ctx.window
        # every position's final hidden state is read (keep_hidden), not only the last one
        return model(input_ids, positions, wrapped, all_logits=all_logits, full_last_layer=True)

    handle = model.model.layers[-1].register_forward_hook(keep_hidden)
    chunk = sparse.prefill_chunk
    t0 = time.perf_counter()
    try:
        run, _ = eng.new_run(n)
        cursor["run"] = run
        with run:
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                inside = [p for p in want if s <= p < e]
                if inside:
                    g = run.cache.gpos.detach().cpu().clone()  # [L, Hkv, G], fixed for the step
                    for p in inside:
                        globals_at[p] = g
                cursor.update(start=s, inside=inside if run.retrieval is not None else [],
                              rpos=None)
                run.step(call, x[s:e])
                if cursor["rpos"] is not None:
                    for p in inside:
                        retrieved_at[p] = cursor["rpos"]
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - t0
            trace = Trace(config=sparse, hidden=hidden, seconds=seconds,
                          kv_bytes_peak=int(run.kv_bytes_peak), recalibrations=run.seq.recalibrations,
                          sinks=run.seq.sinks, window=run.seq.window, q_positions=want,
                          globals_at=globals_at, retrieved_at=retrieved_at, window_at=window_at,
                          offload_bytes=int(run.offload_bytes),
                          retrieval=run.retrieval.stats.to_dict() if run.retrieval else {})
    finally:
        handle.remove()
    if recorder is not None:
        trace.k, trace.q = list(recorder.k), list(recorder.q)
    return trace


__all__ = ["Trace", "teacher_forced", "logits_at", "engine_with", "CaptureContext", "QKRecorder"]
