"""`hisparse plan [PATH]`: the memory plan of a run before anything is loaded (registered by
cli.py).

With PATH (a document, a folder, or `-` for stdin) the document is read as `summarize` reads
it and counted with the model's tokenizer alone (plan_document.py: the pipeline runs on a
dry engine), and the plan says its tokens, the strategy and chunk count, the attention, and
the memory for the largest generation of that run. Without PATH, `--context` tokens.

The model is a built-in shape (`llama-3-8b`, `llama-3-8b-awq`, `mistral-7b`, `qwen2.5-7b`,
`smollm2-135m`: no weights needed) or anything `--model` accepts elsewhere, resolved without
downloading (its config.json is read). Settings: CLI flag > profile > built-in default; the
plan is for the profile's device (a GPU profile plans CUDA even on a CPU-only machine).
stdout gets the plan (a table, or one JSON document with --json); `--check` exits 5 when the
plan does not fit the budget: --budget-gib, else the profile's VRAM budget on CUDA, else (on
the CPU) this machine's physical RAM. `--attention auto` (the default) plans what summarize
would run: dense attention when its whole KV fits that budget, else the largest sparse working
set that fits (planner/attention_choice.py); the choice and its reason are a row of the table and
`settings.attention` in the JSON. Settings no summarize run accepts (a sparse size above
the model's positions, a --max-new-tokens that leaves no room for a prompt) are refused the
same way (engine.config.check_positions, exit 2).
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from hisparse_cli.cli.options import Attention, Strategy, finite_float, sparse_options

P_MODEL, P_SPARSE, P_MEM = "Model and profile", "Sparse attention", "Memory"
P_DOC = "Document (with PATH)"


class WeightFormat(str, Enum):
    fp16 = "fp16"
    bf16 = "bf16"
    fp32 = "fp32"
    awq = "awq-int4"


class LMHeadFormat(str, Enum):
    checkpoint = "checkpoint"
    int8 = "int8"


class KVDtype(str, Enum):
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


class Device(str, Enum):
    cuda = "cuda"
    cpu = "cpu"


class Backend(str, Enum):
    triton = "triton"
    torch = "torch"


_BUDGET, _BUDGET_NOTE = finite_float(0.01)  # never inf/nan (Typer's min= lets them through)


def _opt(*decls: str, panel: str, **kw):
    return typer.Option(*decls, rich_help_panel=panel, **kw)


def _quantized_lm_head(folder: Path) -> bool:
    """Does the checkpoint hold lm_head as INT4 (reads safetensors headers only)?"""
    from hisparse_cli.model.loader import safetensors_files

    try:
        from safetensors import safe_open

        return any("lm_head.qweight" in safe_open(str(f), framework="pt").keys()
                   for f in safetensors_files(folder))
    except Exception:  # noqa: BLE001 - a header we cannot read: assume the usual fp16 head
        return False


def resolve_config(spec: str | None):
    """(ModelConfig, display name, AWQ lm_head?) for a shape name or a model spec."""
    from hisparse_cli.model.config import ModelConfig
    from hisparse_cli.planner.shapes import is_shape, shape_config

    if is_shape(spec):
        return shape_config(spec), spec.strip().lower(), False
    from hisparse_cli.hub.resolve import resolve_model

    folder = Path(resolve_model(spec, auto_pull=False))
    return ModelConfig.from_folder(folder), folder.name, _quantized_lm_head(folder)


@sparse_options
def plan(
    path: Annotated[Optional[str], typer.Argument(
        metavar="PATH", help="A document, folder or - (stdin) to plan for: its tokens, strategy, chunks and "
             "memory, counted with the tokenizer alone (no weights).",
        show_default=False)] = None,
    model: Annotated[Optional[str], _opt("--model", "-m", panel=P_MODEL, help=(
        "A built-in shape (llama-3-8b, llama-3-8b-awq, mistral-7b, qwen2.5-7b, smollm2-135m) "
        "or a model as summarize takes it (its config.json is read; nothing is downloaded). "
        " [default: the embedded default model]"))] = None,
    profile: Annotated[str, _opt("--profile", "-p", panel=P_MODEL, help=(
        "Hardware profile: a name, 'auto' or a .toml file."))] = "auto",
    context: Annotated[Optional[int], _opt("--context", "-c", panel=P_MODEL, min=1, help=(
        "Prompt tokens.  [default: the model's positions minus --max-new-tokens]"))] = None,
    max_new_tokens: Annotated[Optional[int], _opt("--max-new-tokens", "-n", panel=P_MODEL,
                                                  min=0, help="Summary length in tokens. "
                                                  " [default: the profile's]")] = None,
    attention: Annotated[Optional[Attention], _opt("--attention", panel=P_SPARSE,
        case_sensitive=False, help="auto: dense when the whole KV fits the budget, else the "
        "largest sparse working set that fits (as summarize decides); dense; sparse.  "
        "[default: the profile's, auto]")] = None,
    dense: Annotated[bool, _opt("--dense", panel=P_SPARSE,
                                help="Same as --attention dense.")] = False,
    weight_format: Annotated[Optional[WeightFormat], _opt("--weight-format", panel=P_MEM, help=(
        "Override the weights' format.  [default: what the checkpoint holds]"))] = None,
    embeddings_on_host: Annotated[Optional[bool], _opt(
        "--embeddings-on-host/--embeddings-on-device", panel=P_MEM, help=(
            "Keep the embedding table in host RAM.  [default: the profile's]"))] = None,
    lm_head_format: Annotated[Optional[LMHeadFormat], _opt("--lm-head-format", panel=P_MEM,
        case_sensitive=False, help=("The output head as the checkpoint has it, or INT8 "
                                    "(quantized at load; half the bytes).  [default: the "
                                    "profile's]"))] = None,
    kv_dtype: Annotated[Optional[KVDtype], _opt("--kv-dtype", panel=P_MEM)] = None,
    device: Annotated[Optional[Device], _opt("--device", panel=P_MEM, help=(
        "Plan for this device.  [default: the profile's]"))] = None,
    backend: Annotated[Optional[Backend], _opt("--backend", panel=P_MEM, help=(
        "Kernel backend on CUDA.  [default: triton]"))] = None,
    budget_gib: Annotated[Optional[float], _opt("--budget-gib", panel=P_MEM, parser=_BUDGET,
        help=("Memory budget in GiB: VRAM on CUDA, host RAM on the CPU.  [default: the "
              f"profile's on CUDA; this machine's RAM on the CPU]  {_BUDGET_NOTE}"))] = None,
    check: Annotated[bool, _opt("--check", panel=P_MEM, help=(
        "Exit with code 5 when the plan does not fit the budget."))] = False,
    strategy: Annotated[Strategy, _opt("--strategy", panel=P_DOC, case_sensitive=False,
        help="With PATH: as summarize's --strategy.")] = Strategy.auto,
    chunk_tokens: Annotated[Optional[int], _opt("--chunk-tokens", panel=P_DOC, min=16,
        help="With PATH: as summarize's --chunk-tokens.")] = None,
    chunk_new_tokens: Annotated[Optional[int], _opt("--chunk-new-tokens", panel=P_DOC, min=16,
        help="With PATH: as summarize's --chunk-new-tokens.")] = None,
    instructions: Annotated[Optional[str], _opt("--instructions", "-i", panel=P_DOC,
        help="With PATH: as summarize's --instructions.")] = None,
    title: Annotated[Optional[str], _opt("--title", panel=P_DOC,
        help="With PATH: as summarize's --title.")] = None,
    password: Annotated[Optional[str], _opt("--password", panel=P_DOC,
        help="With PATH: password of an encrypted PDF.")] = None,
    include_secrets: Annotated[bool, _opt("--include-secrets", panel=P_DOC,
        help="With PATH: as summarize's --include-secrets.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
    sparse_flags: Optional[dict] = None,
) -> None:
    """Predict the GPU (or host) memory of a summarize run, line by line; with PATH, also the
    document's tokens, strategy, chunks and attention, before any weights load.

    When the run does not fit, the plan also says what to change."""
    from dataclasses import replace

    from hisparse_cli.cli.options import RunOptions
    from hisparse_cli.config.profiles import load_profile
    from hisparse_cli.console import print_table, write_result
    from hisparse_cli.errors import ConfigError
    from hisparse_cli.planner.attention_choice import choose_attention

    doc = None
    if path is not None:  # the document first: a missing one costs nothing (no torch yet)
        from hisparse_cli.cli.summarize import check_input
        from hisparse_cli.documents import load_document

        if context is not None:
            raise ConfigError("--context plans a number of tokens; with PATH the document's "
                              "own tokens are planned", hint="give PATH or --context, not both")
        check_input(path)
        doc = load_document(path if path == "-" else Path(path), password=password,
                            include_secrets=include_secrets, title=title)
    prof = load_profile(profile)
    opts = RunOptions(dense=dense, attention=attention, sparse_flags=sparse_flags or {})
    mode = opts.attention_mode(prof)  # --dense with --attention sparse: exit 2
    sparse = opts.sparse(prof)  # dense with a window or other sparse-only flag: exit 2
    from hisparse_cli.planner.memory import GIB
    from hisparse_cli.planner.profile import plan_for_profile

    cfg, name, awq_head = resolve_config(model)
    new = prof.max_new_tokens if max_new_tokens is None else max_new_tokens
    ctx = context if context is not None else max(1, cfg.max_position_embeddings - new)
    report = None
    if doc is not None:
        from hisparse_cli.cli.plan_document import plan_for_document

        report = plan_for_document(doc, model, cfg, new, strategy=strategy.value,
                                   chunk_tokens=chunk_tokens, chunk_new_tokens=chunk_new_tokens,
                                   instructions=instructions)
        ctx, new = report.peak_generation

    def plan_with(policy, cache_layers: int | None = 0):
        return plan_for_profile(
            cfg, prof, context_tokens=ctx, max_new_tokens=new, sparse=policy,
            device_kind=device.value if device else None,
            backend=backend.value if backend else None,
            weight_format=weight_format.value if weight_format else None,
            kv_dtype=kv_dtype.value if kv_dtype else None, embeddings_on_host=embeddings_on_host,
            awq_lm_head=awq_head, lm_head_format=lm_head_format.value if lm_head_format else None,
            budget_bytes=int(budget_gib * GIB) if budget_gib else None,
            model_name=name, prefill_cache_layers=cache_layers)

    kind = device.value if device else ("cpu" if prof.vram_budget_gib is None else "cuda")
    choice = choose_attention(mode, sparse=sparse, plan=plan_with, context_tokens=ctx + new,
                              explicit_sparse=opts.explicit_sparse(),
                              budget_name="the given budget" if budget_gib else (
                                  "host RAM" if kind == "cpu" else "VRAM budget"))
    from hisparse_cli.planner.memory import with_prefill_cache_info

    result = with_prefill_cache_info(plan_with(choice.sparse), plan_with(choice.sparse, None))
    result = replace(result, settings={**result.settings, "attention": choice.to_dict()})
    if report is not None:
        from hisparse_cli.cli.plan_document import attention_choice, document_json, document_table

        attention = attention_choice(choice)
    if as_json:
        out = result.to_dict()
        if report is not None:
            out = {"input": document_json(doc, report, attention), **out}
        write_result(json.dumps(out, indent=2, default=str))
    else:
        from hisparse_cli.planner.render import render_plan

        if report is not None:
            print_table(document_table(doc, report, attention), to_stdout=True)
        print_table(render_plan(result), to_stdout=True)
    if check:
        from hisparse_cli.planner.vram import check_plan_fits

        check_plan_fits(result)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


__all__ = ["plan", "register", "resolve_config"]
