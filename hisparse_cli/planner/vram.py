"""VRAM budget enforcement: cap torch's CUDA allocator, refuse plans that do not fit, and turn
out-of-memory errors into `ResourceError` (exit code 5).

Budget conventions (the profiles' TOML comments state the same arithmetic):
  * a profile's `vram_budget_gib` is what the run may *allocate* (torch's allocated bytes, the
    planner's `peak_allocated_bytes`); what the card gives to a display, the CUDA context and
    a fragmentation margin were subtracted when the profile was written: `card_budget_bytes`
    (4060ti-6g: a 6 GiB card - 300 MiB display - 595 MiB context - 256 MiB margin = 4993 MiB,
    the profile's 4.875 GiB).
  * `apply_budget(budget)` emulates that card on a bigger GPU: the caching allocator may then
    reserve at most budget + FRAGMENTATION_MARGIN_BYTES (the card's usable memory; the context
    of this process is outside the allocator on every card, so it is not subtracted again).
  * `apply_budget(card_bytes, card=True)` emulates a consumer card of that physical size
    driving a display: the allocator may reserve card_bytes - DISPLAY_BYTES - the CUDA
    context, what such a card really leaves (benchmarks/gpu_engine.py's emulation caps there).
    For a profile written with `card_budget_bytes`, both caps are the same.
Nothing here imports torch at module import time.
"""

from __future__ import annotations

import gc
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from hisparse_cli.config.env import EXPANDABLE, allocator_setting
from hisparse_cli.errors import ConfigError, ResourceError
from hisparse_cli.planner.memory import CUDA_CONTEXT_BYTES, GIB, MemoryPlan

MIB = 1 << 20
# reserved - allocated at a run's peak: the planner's error (measured -0.6 %, ~31 MiB on the
# 8B AWQ run at 5 GiB, BENCHMARKS.md) plus the caching allocator's rounding and partly used
# segments. Not measured alone yet: gpu_engine.py --only-budget records the reserved peak.
FRAGMENTATION_MARGIN_BYTES = 256 * MIB
# what a consumer card gives to the display it drives (desktop, compositor): a few hundred MiB
DISPLAY_BYTES = 300 * MIB


@dataclass(frozen=True)
class BudgetCap:
    budget_bytes: int  # what the caller asked for
    cap_bytes: int  # what the allocator may reserve
    device_total_bytes: int
    fraction: float  # passed to torch.cuda.set_per_process_memory_fraction

    def to_dict(self) -> dict:
        return asdict(self)


def allocator_cap_bytes(budget_bytes: int, *, card: bool = False,
                        context_bytes: int = CUDA_CONTEXT_BYTES,
                        margin_bytes: int = FRAGMENTATION_MARGIN_BYTES,
                        display_bytes: int = DISPLAY_BYTES) -> int:
    """Bytes torch's allocator may reserve for a budget, or (card=True) on a card of
    `budget_bytes` driving a display (display_bytes=0: a headless card). Module docstring."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ConfigError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
    cap = budget_bytes - display_bytes - context_bytes if card else budget_bytes + margin_bytes
    if cap <= 0:
        raise ConfigError(f"a {budget_bytes / GIB:.2f} GiB card leaves nothing after the "
                          f"{display_bytes / GIB:.2f} GiB display and the "
                          f"{context_bytes / GIB:.2f} GiB CUDA context")
    return cap


def card_budget_bytes(card_bytes: int, *, display_bytes: int = DISPLAY_BYTES,
                      context_bytes: int = CUDA_CONTEXT_BYTES,
                      margin_bytes: int = FRAGMENTATION_MARGIN_BYTES) -> int:
    """The allocation budget a card of `card_bytes` leaves a run: what the allocator may
    reserve there (allocator_cap_bytes(card=True)) less the fragmentation margin. A profile's
    vram_budget_gib must not exceed it for the card it is written for."""
    return allocator_cap_bytes(card_bytes, card=True, context_bytes=context_bytes,
                               display_bytes=display_bytes) - margin_bytes


def budget_fraction(cap_bytes: int, device_total_bytes: int) -> float:
    """The set_per_process_memory_fraction value for a cap (ResourceError if it exceeds the
    device)."""
    if cap_bytes > device_total_bytes:
        raise ResourceError(
            f"the budget needs {cap_bytes / GIB:.2f} GiB but the GPU has "
            f"{device_total_bytes / GIB:.2f} GiB", hint="pick a profile for a smaller card")
    return cap_bytes / device_total_bytes


def apply_budget(budget_bytes: int, device=None, *, card: bool = False) -> BudgetCap:
    """Cap this process's CUDA allocator so the run behaves as on the budget's card."""
    import torch

    if not torch.cuda.is_available():
        raise ResourceError("a VRAM budget needs a CUDA GPU", hint="use --profile cpu")
    dev = torch.device(device if device is not None else "cuda")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = int(torch.cuda.get_device_properties(index).total_memory)
    cap = allocator_cap_bytes(budget_bytes, card=card)
    fraction = budget_fraction(cap, total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return BudgetCap(budget_bytes, cap, total, fraction)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def check_plan_fits(plan: MemoryPlan, what: str = "the run") -> None:
    """ResourceError (exit 5) when the plan's peak exceeds its budget (hint: the suggestions),
    or when its host memory (the retrieval tier's offload store, host-resident weights) does
    not fit this machine's RAM."""
    if plan.host_fits is False:
        raise ResourceError(
            f"{what} needs {_gib(plan.host_bytes)} of host memory (offload store "
            f"{_gib(plan.offload_store_bytes)}) but this machine has {_gib(plan.host_ram_bytes)} "
            "of RAM", hint="summarize fewer tokens per run (--strategy map-reduce, or a shorter "
            "--context), or turn the retrieval tier off (--retrieval-tokens 0); "
            "`hisparse plan` shows the line items")
    if plan.fits is not False:
        return
    hints = [s.change for s in plan.suggestions if s.fits][:3]
    if not hints and plan.suggestions:
        best = min(plan.suggestions, key=lambda s: s.peak_allocated_bytes)
        hints = [f"{best.change} (still needs {_gib(best.peak_allocated_bytes)})"]
    hint = ("try: " + "; or ".join(hints)) if hints else "use a bigger profile or a smaller model"
    memory = "host memory" if plan.settings.get("device_kind") == "cpu" else "GPU memory"
    limit = ("this machine's RAM is" if plan.settings.get("budget_source") == "host RAM"
             else "the budget is")
    raise ResourceError(
        f"{what} needs {_gib(plan.peak_allocated_bytes)} of {memory} at its peak "
        f"({plan.peak_when}) but {limit} {_gib(plan.budget_bytes)}",
        hint=hint + "; `hisparse plan` shows the line items")


_OOM_HINT = ("use a smaller profile, --window, --prefill-chunk or --max-new-tokens; "
             "`hisparse plan` shows what fits")


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory failure: MemoryError, torch's OutOfMemoryError (CUDA), or a
    RuntimeError saying so (a CUDA "out of memory", or the CPU allocator's "can't allocate
    memory" when the host refuses an allocation)."""
    import sys

    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    text = str(exc).lower()
    return (isinstance(exc, MemoryError) or (oom is not None and isinstance(exc, oom))
            or (isinstance(exc, RuntimeError)
                and ("out of memory" in text or "can't allocate memory" in text)))


def oom_error(exc: BaseException, what: str | None = None,
              hint: str | None = None) -> ResourceError | None:
    """The ResourceError (exit 5) for an out-of-memory exception, else None. The message is
    one line: the size the CPU allocator was refused, or the exception's first line."""
    if not is_oom(exc):
        return None
    tried = re.search(r"tried to allocate (\d+) bytes", str(exc))
    if tried and "can't allocate memory" in str(exc).lower():
        first = f"the host could not allocate {_gib(int(tried.group(1)))}"
    else:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:240]
    during = f" during {what}" if what else ""
    fragmented = _fragmented(str(exc))
    if fragmented:
        first = (f"{'. '.join(first.split('. ')[:2])}, while {fragmented} was reserved by "
                 f"torch but unallocated in pieces too small (the allocator is fragmented)")
        hint = (f"add expandable_segments:True to PYTORCH_CUDA_ALLOC_CONF (or unset it: "
                f"hisparse then turns them on), or {hint or _OOM_HINT}")
    return ResourceError(f"out of memory{during}: {first}", hint=hint or _OOM_HINT)


_SIZE = r"([\d.]+) (KiB|MiB|GiB)"


def _fragmented(message: str) -> str | None:
    """"X MiB" where a CUDA out-of-memory message says the caching allocator held at least
    the refused allocation reserved but unallocated (fragmentation, not a full card), and
    expandable segments are not already on; else None."""
    tried = re.search(r"Tried to allocate " + _SIZE, message)
    free = re.search(_SIZE + r" is reserved by PyTorch but unallocated", message)
    if not (tried and free) or EXPANDABLE in allocator_setting():
        return None
    unit = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    want = float(tried.group(1)) * unit[tried.group(2)]
    held = float(free.group(1)) * unit[free.group(2)]
    return f"{free.group(1)} {free.group(2)}" if held >= want else None


def release_cached_memory() -> None:
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def oom_guard(what: str = "the run", hint: str | None = None):
    """Translate an out-of-memory error raised inside the block (GPU or host) into a
    ResourceError, after freeing what the failed step held and emptying torch's cache."""
    err = None
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - re-raised unless it is an OOM
        err = oom_error(exc, what, hint)
        if err is None:
            raise
        del exc  # drop the traceback's frames (and the tensors they hold) before freeing
    if err is not None:
        release_cached_memory()
        raise err


__all__ = ["BudgetCap", "FRAGMENTATION_MARGIN_BYTES", "DISPLAY_BYTES", "allocator_cap_bytes",
           "card_budget_bytes", "budget_fraction",
           "apply_budget", "check_plan_fits", "oom_guard", "oom_error", "is_oom",
           "release_cached_memory"]
