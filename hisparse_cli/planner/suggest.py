"""What to change when a plan does not fit its budget: each suggestion is a re-plan.

Tried in this order, each alone: a smaller prefill chunk, a smaller window, fewer global
tokens, AWQ INT4 weights, the embedding table in host RAM, an fp16 KV cache. Numeric settings
are halved until the plan fits (a few steps at most). When no single change fits: the format
changes together, plus halvings of window, chunk and globals in turn until it fits
(returned either way; its peak says how far the run still is). Last, for a CUDA plan: the
smallest shipped profile whose budget holds the plan as it is (a cpu plan's budget is the
host's RAM, which no profile changes). Only fitting changes are returned, except that
combined one. `replan` is the planner's own function (memory.plan_memory), passed in: this
module sits below the planner and imports nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from hisparse_cli.errors import HisparseError

if TYPE_CHECKING:
    from hisparse_cli.planner.memory import MemoryPlan


@dataclass(frozen=True)
class Suggestion:
    change: str  # what to change, as CLI flags ("--window 1024")
    overrides: dict  # plan_memory keyword overrides that make this plan
    peak_allocated_bytes: int
    fits: bool

MIN_CHUNK = 64
MIN_WINDOW = 256
MAX_HALVINGS = 4


def _replan(plan: MemoryPlan, replan: Callable, **over) -> MemoryPlan | None:
    try:
        return replan(**{**plan.request, **over, "suggest": False})
    except HisparseError:
        return None


def _halvings(value: int, floor: int) -> list[int]:
    out = []
    while len(out) < MAX_HALVINGS and value // 2 >= floor:
        value //= 2
        out.append(value)
    return out


def _first_fit(plan: MemoryPlan, replan: Callable, values: list,
               make) -> Suggestion | None:
    """The suggestion of the first value that makes the plan fit (None: none does)."""
    for value in values:
        change, over = make(value)
        p = _replan(plan, replan, **over)
        if p is not None and p.fits:
            return Suggestion(change, _public(over), p.peak_allocated_bytes, True)
    return None


def _public(over: dict) -> dict:
    out = {}
    for k, v in over.items():
        if k == "sparse":
            out.update({f"sparse.{f}": getattr(v, f) for f in ("window_size", "prefill_chunk",
                                                                "global_tokens",
                                                                "recalibrate_topk")})
        else:
            out[k] = v
    return out


def suggestions(plan: MemoryPlan, replan: Callable) -> list[Suggestion]:
    """The suggestions for a plan that does not fit (module doc); replan: plan_memory."""
    req = plan.request
    sp = req["sparse"]
    cuda = req["device_kind"] == "cuda"
    found: list[Suggestion] = []

    def add(result: Suggestion | None) -> None:
        if result is not None:
            found.append(result)

    floor = max(MIN_CHUNK, sp.block_size)
    add(_first_fit(plan, replan, _halvings(sp.prefill_chunk, floor), lambda c: (
        f"--prefill-chunk {c}", {"sparse": replace(sp, prefill_chunk=c)})))
    windows = (_halvings(sp.window_size, MIN_WINDOW) if sp.window_size is not None
               else [4096, 2048, 1024])
    add(_first_fit(plan, replan, windows, lambda w: (
        f"--window {w}", {"sparse": replace(sp, window_size=w)})))
    if sp.window_size is not None and sp.global_tokens > 0:
        add(_first_fit(plan, replan, _halvings(sp.global_tokens, 1) + [0], lambda g: (
            f"--global-tokens {g} --recalibrate-topk {min(g, sp.recalibrate_topk)}",
            {"sparse": replace(sp, global_tokens=g,
                               recalibrate_topk=min(g, sp.recalibrate_topk))})))
    formats = {}
    if cuda and req["weight_format"] != "awq-int4":
        formats["weight_format"] = "awq-int4"
        add(_first_fit(plan, replan, ["awq-int4"], lambda f: (
            "AWQ INT4 weights (an AWQ checkpoint, or `hisparse quantize`)",
            {"weight_format": f, "compute_dtype": "float16"})))
    if cuda and not req["embeddings_on_host"]:
        formats["embeddings_on_host"] = True
        add(_first_fit(plan, replan, [True], lambda e: (
            "embeddings in host RAM (profile field embeddings_on_host = true)",
            {"embeddings_on_host": e})))
    if cuda and not req["lm_head_int8"] and not req["awq_lm_head"]:
        formats["lm_head_int8"] = True
        add(_first_fit(plan, replan, [True], lambda e: (
            "an INT8 output head (profile field lm_head_format = \"int8\")",
            {"lm_head_int8": e})))
    if req["kv_dtype"] == "float32":
        formats["kv_dtype"] = "float16"
        add(_first_fit(plan, replan, ["float16"],
                       lambda k: ("--kv-dtype float16", {"kv_dtype": k})))
    if not found:
        found.append(_combined(plan, replan, formats))
    profile = _bigger_profile(plan)
    if profile is not None:
        found.append(profile)
    return found


def _combined(plan: MemoryPlan, replan: Callable, formats: dict) -> Suggestion:
    """The format changes together, then the sparse settings shrunk one halving at a time
    (window, chunk, globals, in turn) until the plan fits or nothing is left to shrink."""
    sp = plan.request["sparse"]
    over = dict(formats)
    if formats.get("weight_format") == "awq-int4":
        over["compute_dtype"] = "float16"
    p = _replan(plan, replan, **over)
    cur = sp
    for turn in range(3 * MAX_HALVINGS):
        if p is not None and p.fits:
            break
        nxt = _shrink(cur, turn)
        if nxt is None:
            break
        cur = nxt
        p = _replan(plan, replan, **over, sparse=cur)
    flags = ["lm_head_format=int8" if k == "lm_head_int8" else f"{k}={v}"
             for k, v in formats.items()]
    for name, flag in (("prefill_chunk", "--prefill-chunk"), ("window_size", "--window"),
                       ("global_tokens", "--global-tokens")):
        if getattr(cur, name) != getattr(sp, name):
            flags.append(f"{flag} {getattr(cur, name)}")
    if cur is not sp:
        over["sparse"] = cur
    peak = p.peak_allocated_bytes if p is not None else plan.peak_allocated_bytes
    return Suggestion("together: " + " ".join(flags), _public(over), peak,
                      bool(p is not None and p.fits))


def _shrink(sp, turn: int):
    """One more halving, taking window, chunk and globals in turn (None: all at the floors)."""
    for i in range(3):
        kind = (turn + i) % 3
        if kind == 0 and sp.window_size is not None and sp.window_size // 2 >= MIN_WINDOW:
            return replace(sp, window_size=sp.window_size // 2)
        if kind == 1 and sp.prefill_chunk // 2 >= max(MIN_CHUNK, sp.block_size):
            return replace(sp, prefill_chunk=sp.prefill_chunk // 2)
        if kind == 2 and sp.window_size is not None and sp.global_tokens > 0:
            g = sp.global_tokens // 2
            return replace(sp, global_tokens=g, recalibrate_topk=min(g, sp.recalibrate_topk))
    return None


def _bigger_profile(plan: MemoryPlan) -> Suggestion | None:
    from hisparse_cli.config.profiles import list_profiles

    if plan.request["device_kind"] != "cuda":
        return None
    need = plan.peak_allocated_bytes
    fitting = [p for p in list_profiles()
               if p.vram_budget_bytes is not None and p.vram_budget_bytes >= need]
    if not fitting:
        return None
    best = min(fitting, key=lambda p: p.vram_budget_bytes)
    return Suggestion(f"--profile {best.name} (a {best.vram_budget_gib:g} GiB budget; these "
                      f"settings)", {"budget_bytes": best.vram_budget_bytes}, need, True)
