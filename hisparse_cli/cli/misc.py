"""Small commands: `score`, `profiles list|show`, `models list|pull|path|rm`.

Their output (a table, a path, a JSON document) is the result, so it goes to stdout;
progress and notes go to stderr.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]

profiles_app = typer.Typer(help="Hardware profiles (bundled sparse + memory settings).")
models_app = typer.Typer(help="Models: the embedded default, pulled and converted ones.")


def _print_json(obj) -> None:
    from hisparse_cli.console import write_result

    write_result(json.dumps(obj, ensure_ascii=False, indent=2, default=str))


def score(
    summary: Annotated[Path, typer.Argument(help="Summary text file.", show_default=False,
                                            readable=False)],
    reference: Annotated[Path, typer.Argument(help="Reference text file.", show_default=False,
                                              readable=False)],
    as_json: JsonOpt = False,
) -> None:
    """ROUGE-1/2/L/Lsum F1 of SUMMARY against REFERENCE."""
    from hisparse_cli.console import write_result
    from hisparse_cli.summarize.job import read_reference
    from hisparse_cli.scoring import rouge_scores

    scores = rouge_scores(read_reference(summary, "summary", "SUMMARY"),
                          read_reference(reference, "reference", "REFERENCE"))
    if as_json:
        _print_json(scores)
    else:
        write_result("\n".join(f"{name}\t{value:.4f}" for name, value in scores.items()))


def _weights_shown(profile) -> str:
    """The profile's weight_format as a run under it loads the weights: the cpu profile's
    unquantized weights run in float32 (runtime.plan_device), whatever the checkpoint holds."""
    from hisparse_cli.summarize.runtime import plan_device

    dtype = plan_device(profile, cuda_available=True).dtype  # on the device it is made for
    if profile.weight_format == "fp16" and dtype != "float16":
        return f"fp16, loaded as {dtype}"
    return profile.weight_format


@profiles_app.command("list")
def profiles_list(as_json: JsonOpt = False) -> None:
    """List the shipped profiles."""
    from rich.markup import escape
    from rich.table import Table

    from hisparse_cli.console import print_table
    from hisparse_cli.config.profiles import list_profiles

    profiles = list_profiles()
    if as_json:
        _print_json([p.to_dict() for p in profiles])
        return
    table = Table("name", "VRAM budget", "window", "globals", "weights", "description")
    for p in profiles:
        budget = f"{p.vram_budget_gib:g} GiB" if p.vram_budget_gib else "cpu"
        table.add_row(escape(p.name), budget, str(p.sparse.window_size), str(p.sparse.global_tokens),
                      _weights_shown(p), escape(p.description))
    print_table(table, to_stdout=True)


@profiles_app.command("show")
def profiles_show(
    name: Annotated[str, typer.Argument(help="Profile name, 'auto' or a .toml path.",
                                        show_default=False)],
    as_json: JsonOpt = False,
) -> None:
    """Show every setting of one profile ('auto' shows the one this machine gets)."""
    from rich.markup import escape
    from rich.table import Table

    from hisparse_cli.console import print_table
    from hisparse_cli.config.profiles import load_profile

    profile = load_profile(name)
    if as_json:
        _print_json(profile.to_dict())
        return
    table = Table("setting", "value", title=f"profile {profile.name}", title_justify="left")
    for key, value in profile.to_dict().items():
        if key == "weight_format":
            value = _weights_shown(profile)
        rows = value.items() if key == "sparse" else [(None, value)]
        for sub, shown in rows:  # the [sparse] table's fields as sparse.NAME
            table.add_row(f"{key}.{sub}" if sub else key,
                          "none" if shown is None else escape(str(shown)))
    print_table(table, to_stdout=True)


@models_app.command("list")
def models_list(as_json: JsonOpt = False) -> None:
    """List known and installed models."""
    from rich.markup import escape
    from rich.table import Table

    from hisparse_cli.console import human_bytes, print_table
    from hisparse_cli.hub import list_models

    rows = list_models()
    if as_json:
        _print_json([{**asdict(r), "path": str(r.path)} for r in rows])
        return
    table = Table("name", "installed", "size", "source", "description")
    table.columns[0].no_wrap = True  # a name is what users copy: never cut, even on a terminal
    for r in rows:
        name = r.name + (" (default)" if r.is_default else "")
        table.add_row(name, "yes" if r.installed else "no",
                      human_bytes(r.size_bytes) if r.installed else "-", r.source,
                      escape(r.description))
    print_table(table, to_stdout=True)


@models_app.command("pull")
def models_pull(
    name: Annotated[str, typer.Argument(help="Registry name (see `models list`).",
                                        show_default=False)],
    force: Annotated[bool, typer.Option("--force", help="Convert again.")] = False,
) -> None:
    """Download (from PyPI) and convert a registry model; prints its folder. On a machine
    with a CUDA GPU, a note names `hisparse warmup`, which compiles the GPU kernels ahead."""
    from hisparse_cli.console import note, stderr_console, write_result
    from hisparse_cli.hub import pull_model

    write_result(str(pull_model(name, progress=stderr_console(), force=force)))
    import torch

    if torch.cuda.is_available():  # nothing is compiled for the CPU: no note there
        note(f"to compile its GPU kernels now instead of in the first summarize: "
             f"hisparse warmup --model {name} [--profile P]")


@models_app.command("path")
def models_path(
    name: Annotated[str, typer.Argument(help="Installed model name.", show_default=False)],
) -> None:
    """Print the folder of an installed model."""
    from hisparse_cli.console import write_result
    from hisparse_cli.hub import model_path

    write_result(str(model_path(name)))


@models_app.command("rm")
def models_rm(
    name: Annotated[str, typer.Argument(help="Installed model name.", show_default=False)],
    download: Annotated[bool, typer.Option(
        "--download", help="Also delete the cached download (wheel).")] = False,
) -> None:
    """Delete an installed model's converted folder."""
    from hisparse_cli.console import note
    from hisparse_cli.hub import remove_model

    removed = remove_model(name, remove_download=download)
    note(f"removed {name}" if removed else f"{name} is not installed; nothing to remove")


def register(app: typer.Typer) -> None:
    app.command("score")(score)
    app.add_typer(profiles_app, name="profiles")
    app.add_typer(models_app, name="models")
