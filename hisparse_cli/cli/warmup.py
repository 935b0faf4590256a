"""`hisparse warmup`: compile the GPU kernels a summarize setup needs, once per machine.

Takes summarize's flags (the same profile, model, sparse and decoding settings pick the same
kernels) and `--context N`, the longest prompt to prepare for (summarize/warmup.py says
which generations run and why). The result, on stdout: a table of the kernels compiled (a
Triton specialization or an NVRTC cubin the disk cache did not have) or loaded from the
cache, per kernel, and a total line with the time; `--json`: one JSON object. Progress goes
to stderr. Without a CUDA GPU there is nothing to compile: it says so and exits 0, before
any model is resolved or loaded. Exit codes as summarize's: 2 bad flags or profile, 4 the
model, 5 out of memory.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from hisparse_cli.cli.options import P_OUT, RunOptions, run_options


def _cpu_note(profile) -> str | None:
    """Why nothing is compiled here (None where the profile runs on a CUDA GPU)."""
    import torch

    from hisparse_cli.summarize.runtime import plan_device

    cuda = torch.cuda.is_available()
    if plan_device(profile, cuda).device == "cuda":
        return None
    why = "no CUDA GPU" if not cuda else f"profile {profile.name!r} runs on the CPU"
    return (f"nothing to compile: {why}; the CPU runs no Triton or NVRTC kernels (its decode "
            "library builds itself in about a second on first use)")


def warmup(
    context: Annotated[Optional[int], typer.Option(
        "--context", "-c", min=1, rich_help_panel=P_OUT,
        help="The longest prompt to prepare for, in tokens (longer documents need no other "
             "kernels).  [default: 8192, or the model's positions if fewer]")] = None,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT,
                                          help="Print one JSON object.")] = False,
    *, opts: RunOptions,
) -> None:
    """Compile ahead the GPU kernels that summarize with the same flags runs (once per machine
    and driver; later runs load them from the cache)."""
    from hisparse_cli.cli.summarize import build_job
    from hisparse_cli.console import note, print_table, write_result

    job = build_job(opts)  # bad flags or profile: exit 2, before torch
    why = _cpu_note(job.profile)
    if why is not None:
        if as_json:
            write_result(json.dumps({"device": "cpu", "note": why, "kernel_compiles": 0,
                                     "kernel_loads": 0, "steps": []}))
        else:
            write_result(why)
        return
    from hisparse_cli.kernels.compile_cache import use_triton_cache
    from hisparse_cli.kernels.compile_log import compile_counts
    from hisparse_cli.kernels.cuda.cuda_rt import kernel_cache_dir
    from hisparse_cli.summarize.warmup import default_context, run_warmup, warmup_steps

    before = compile_counts()
    engine = job.engine()
    longest = context or default_context(int(engine.cfg.max_position_embeddings))
    steps = warmup_steps(job.settings.generation, longest)

    def progress(i: int, n: int, step) -> None:
        if not opts.quiet:
            note(f"warmup {i + 1}/{n}: {step.prompt_tokens:,} tokens ({step.decoding})")

    report = run_warmup(job, steps, progress)
    kernels = (compile_counts() - before).by_kernel
    cache = use_triton_cache()
    out = {"device": "cuda", "model": job.model, "profile": job.profile.name,
           "context": longest, **report.to_dict(), "kernels": dict(kernels),
           "triton_cache": cache.path, "triton_cache_source": cache.source,
           "nvrtc_cache": str(kernel_cache_dir())}
    if as_json:
        write_result(json.dumps(out, default=str, indent=2))
        return
    from rich.table import Table

    table = Table("kernel", "specializations", title="hisparse warmup", title_justify="left")
    for name, count in kernels:
        table.add_row(name, str(count))
    print_table(table, to_stdout=True)
    write_result(f"compiled {out['kernel_compiles']} kernels in "
                 f"{out['kernel_compile_seconds']:.1f} s, loaded {out['kernel_loads']} from the "
                 f"cache in {out['kernel_load_seconds']:.1f} s; {len(steps)} generations up to "
                 f"{longest:,} tokens in {report.seconds:.1f} s; cache: {cache.path}")


def register(app: typer.Typer) -> None:
    app.command("warmup")(run_options(warmup))
