"""What to change when a plan does not fit its budget: each suggestion is a re-plan.

Tried in this order, each alone: a smaller prefill chunk, a smaller window, fewer global
tokens, AWQ INT4 weights, the embedding table in host RAM, an fp16 KV cache; then all of them
together; then the smallest shipped profile whose budget holds the plan as it is. Numeric
settings are halved until the plan fits (a few steps at most). Only changes that make the plan
fit are returned, except the combined one, which is returned either way when nothing else fits
(its peak says how far the run still is from the budget).
"""

from __future__ import annotations

from dataclasses import replace

from hisparse_cli.errors import HisparseError
from hisparse_cli.planner import MemoryPlan, Suggestion, plan_memory

MIN_CHUNK = 64
MIN_WINDOW = 256
MAX_HALVINGS = 4


def _replan(plan: MemoryPlan, **over) -> MemoryPlan | None:
    try:
        return plan_memory(**{**plan.request, **over, "suggest": False})
    except HisparseError:
        return None


def _halvings(value: int, floor: int) -> list[int]:
    out = []
    while len(out) < MAX_HALVINGS and value // 2 >= floor:
        value //= 2
        out.append(value)
    return out


def _first_fit(plan: MemoryPlan, values: list, make) -> tuple[Suggestion | None, dict | None]:
    """(the first value's suggestion that fits, the overrides of the last value tried)."""
    last = None
    for value in values:
        change, over = make(value)
        last = over
        p = _replan(plan, **over)
        if p is not None and p.fits:
            return Suggestion(change, _public(over), p.peak_allocated_bytes, True), over
    return None, last


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


def suggestions(plan: MemoryPlan) -> list[Suggestion]:
    req = plan.request
    sp = req["sparse"]
    cuda = req["device_kind"] == "cuda"
    found: list[Suggestion] = []
    tried: dict = {}

    def add(result: tuple[Suggestion | None, dict | None], key: str) -> None:
        sug, last = result
        if sug is not None:
            found.append(sug)
        if last is not None:
            tried[key] = last

    floor = max(MIN_CHUNK, sp.block_size)
    add(_first_fit(plan, _halvings(sp.prefill_chunk, floor), lambda c: (
        f"--prefill-chunk {c}", {"sparse": replace(sp, prefill_chunk=c)})), "chunk")
    windows = (_halvings(sp.window_size, MIN_WINDOW) if sp.window_size is not None
               else [4096, 2048, 1024])
    add(_first_fit(plan, windows, lambda w: (
        f"--window {w}", {"sparse": replace(sp, window_size=w)})), "window")
    if sp.window_size is not None and sp.global_tokens > 0:
        add(_first_fit(plan, _halvings(sp.global_tokens, 1) + [0], lambda g: (
            f"--global-tokens {g} --recalibrate-topk {min(g, sp.recalibrate_topk)}",
            {"sparse": replace(sp, global_tokens=g,
                               recalibrate_topk=min(g, sp.recalibrate_topk))})), "globals")
    formats = {}
    if cuda and req["weight_format"] != "awq-int4":
        formats["weight_format"] = "awq-int4"
        add(_first_fit(plan, ["awq-int4"], lambda f: (
            "AWQ INT4 weights (an AWQ checkpoint, or `hisparse quantize`)",
            {"weight_format": f, "compute_dtype": "float16"})), "awq")
    if cuda and not req["embeddings_on_host"]:
        formats["embeddings_on_host"] = True
        add(_first_fit(plan, [True], lambda e: (
            "embeddings in host RAM (profile field embeddings_on_host = true)",
            {"embeddings_on_host": e})), "host")
    if req["kv_dtype"] == "float32":
        formats["kv_dtype"] = "float16"
        add(_first_fit(plan, ["float16"], lambda k: ("--kv-dtype float16", {"kv_dtype": k})),
            "kv")
    if not found:
        small = replace(sp, prefill_chunk=min([sp.prefill_chunk] + [
            t["sparse"].prefill_chunk for t in tried.values() if "sparse" in t]))
        if "window" in tried:
            small = replace(small, window_size=tried["window"]["sparse"].window_size)
        if "globals" in tried:
            small = replace(small, global_tokens=0, recalibrate_topk=0)
        over = {**formats, "sparse": small}
        if "weight_format" in formats:
            over["compute_dtype"] = "float16"
        p = _replan(plan, **over)
        if p is not None:
            flags = [f"--prefill-chunk {small.prefill_chunk}"]
            if small.window_size is not None:
                flags.append(f"--window {small.window_size}")
            if "globals" in tried:
                flags.append("--global-tokens 0")
            flags += [f"{k}={v}" for k, v in formats.items()]
            found.append(Suggestion("all together: " + " ".join(flags), _public(over),
                                    p.peak_allocated_bytes, bool(p.fits)))
    profile = _bigger_profile(plan)
    if profile is not None:
        found.append(profile)
    return found


def _bigger_profile(plan: MemoryPlan) -> Suggestion | None:
    from hisparse_cli.profiles import list_profiles

    need = plan.peak_allocated_bytes
    fitting = [p for p in list_profiles()
               if p.vram_budget_bytes is not None and p.vram_budget_bytes >= need]
    if not fitting:
        return None
    best = min(fitting, key=lambda p: p.vram_budget_bytes)
    return Suggestion(f"--profile {best.name} (a {best.vram_budget_gib:g} GiB budget; these "
                      f"settings)", {"budget_bytes": best.vram_budget_bytes}, need, True)
