"""Rich rendering of a `MemoryPlan` for `hisparse plan` (the table is the command's result)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from hisparse_cli.planner.memory import MemoryPlan


def _b(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,} B"


def plan_table(plan: MemoryPlan) -> Table:
    s = plan.settings
    sp = s["sparse"]
    window = "dense" if sp["window_size"] is None else f"window {sp['window_size']}"
    title = (f"hisparse plan: {plan.model}, {s['context_tokens']:,} + {s['max_new_tokens']:,} "
             f"tokens, {s['weight_format']}, {window}, chunk {sp['prefill_chunk']}, "
             f"{s['device_kind']}/{s['backend']}")
    table = Table(title=title, title_justify="left")
    table.add_column("item")
    table.add_column("bytes", justify="right")
    table.add_column("how")
    for item in plan.items:
        if item.counted:
            table.add_row(item.name, _b(item.bytes), item.formula)
    table.add_section()
    table.add_row(Text("peak allocated", style="bold"), Text(_b(plan.peak_allocated_bytes),
                                                             style="bold"), plan.peak_when)
    if plan.cuda_context_bytes:
        table.add_row("CUDA context", _b(plan.cuda_context_bytes),
                      "outside torch's allocator (not in max_memory_allocated)")
        table.add_row("device total", _b(plan.device_total_bytes), "peak + context")
    if plan.host_bytes or plan.offload_store_bytes:
        ram = (f" of {_b(plan.host_ram_bytes)} RAM: "
               + ("fits" if plan.host_fits else "does NOT fit")) if plan.host_ram_bytes else ""
        table.add_row("host bytes", _b(plan.host_bytes),
                      f"offload store {_b(plan.offload_store_bytes)} + host-resident "
                      f"weights{ram}")
    if plan.budget_bytes is not None:
        verdict = Text("fits", style="green") if plan.fits else Text("does NOT fit",
                                                                      style="bold red")
        source = s.get("budget_source")
        table.add_row("budget (host RAM)" if source == "host RAM" else "budget",
                      _b(plan.budget_bytes),
                      Text.assemble(verdict, f" (headroom {_b(plan.headroom_bytes)})"))
    attention = s.get("attention")
    if attention:
        table.add_row("attention", "dense" if attention["window_size"] is None else "sparse",
                      f"{attention['requested']}: {attention['reason']}")
    table.add_section()
    for item in plan.items:
        if not item.counted:
            table.add_row(Text(item.name, style="dim"), Text(_b(item.bytes), style="dim"),
                          Text(item.formula, style="dim"))
    return table


def suggestions_table(plan: MemoryPlan) -> Table | None:
    if not plan.suggestions:
        return None
    table = Table(title="what to change", title_justify="left")
    table.add_column("change")
    table.add_column("peak", justify="right")
    table.add_column("fits")
    for s in plan.suggestions:
        table.add_row(s.change, _b(s.peak_allocated_bytes), "yes" if s.fits else "no")
    return table


def execution_table(plan: MemoryPlan) -> Table | None:
    """The run's execution plan (config/execution.py): each choice, its value and why."""
    if plan.execution is None:
        return None
    table = Table(title="execution", title_justify="left")
    table.add_column("choice")
    table.add_column("value")
    table.add_column("why")
    for name, value, reason in plan.execution.rows():
        table.add_row(name, value, reason)
    return table


def render_plan(plan: MemoryPlan) -> Group:
    parts = [plan_table(plan)]
    execution = execution_table(plan)
    if execution is not None:
        parts.append(execution)
    sug = suggestions_table(plan)
    if sug is not None:
        parts.append(sug)
    for note in plan.notes:
        parts.append(Text(f"note: {note}", style="dim"))
    return Group(*parts)


__all__ = ["plan_table", "execution_table", "suggestions_table", "render_plan"]
