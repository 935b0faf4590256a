"""`hisparse plan PATH`'s document part: the dry run's inputs, the attention line, rendering.

`plan_for_document` builds the summary settings exactly as `summarize` does from the same
flags (strategy, chunk sizes, instructions, --max-new-tokens) and runs summarize/plan_document.py;
`attention_choice` is the one place that says which attention the run will use;
`document_table` / `document_json` show the result (the memory plan follows it).
"""

from __future__ import annotations

from rich.table import Table

from hisparse_cli.documents.base import Document
from hisparse_cli.errors import ConfigError
from hisparse_cli.summarize.plan_document import DocumentPlan, load_tokenizer, plan_document


def plan_for_document(doc: Document, model_spec: str | None, cfg, max_new_tokens: int, *,
                      strategy: str, chunk_tokens: int | None, chunk_new_tokens: int | None,
                      instructions: str | None) -> DocumentPlan:
    """The dry run of `doc` for the model `model_spec` (its tokenizer; no weights)."""
    from pathlib import Path

    from hisparse_cli.config.settings import GenerationConfig
    from hisparse_cli.hub.resolve import resolve_model
    from hisparse_cli.summarize.pipeline import SummarySettings
    from hisparse_cli.planner.shapes import is_shape

    if is_shape(model_spec):
        raise ConfigError(f"--model {model_spec} is a built-in shape without a tokenizer, so a "
                          "document cannot be counted with it",
                          hint="give a model folder, a .gguf or a registry name (or leave "
                               "--model out for the default model)")
    folder = Path(resolve_model(model_spec, auto_pull=False))
    settings = SummarySettings(strategy=strategy,
                               generation=GenerationConfig(max_new_tokens=max_new_tokens),
                               chunk_tokens=chunk_tokens, chunk_new_tokens=chunk_new_tokens,
                               instructions=instructions)
    return plan_document(doc, load_tokenizer(folder), cfg, settings)


def attention_choice(choice) -> dict:
    """Which attention the summarize run uses, and why: `choice` is the run's own decision
    (planner/attention_choice.py:choose_attention, the rule `summarize` applies to the
    document's largest generation)."""
    return {"attention": choice.mode, "reason": f"{choice.requested}: {choice.reason}",
            "attention_choice": choice.to_dict()}


def document_json(doc: Document, report: DocumentPlan, attention: dict) -> dict:
    from hisparse_cli.summarize.job import document_info

    return {"document": document_info(doc), **report.to_dict(), **attention}


def document_table(doc: Document, report: DocumentPlan, attention: dict) -> Table:
    table = Table(title=f"hisparse plan: {doc.source}", title_justify="left", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    unit = {"pdf": "pages", "repository": "files", "collection": "documents"}.get(doc.kind)
    size = f", {len(doc.sections):,} {unit}" if unit else ""
    skipped = f", {len(doc.skipped)} skipped" if doc.skipped else ""
    table.add_row("document", f"{doc.kind} ({doc.genre}){size}{skipped}")
    table.add_row("document tokens", f"{report.document_tokens:,}")
    if report.strategy == "stream":
        table.add_row("strategy", f"stream (1 chunk): the prompt holds {report.prompt_tokens:,} "
                                  f"of the model's {report.max_positions:,} positions")
        table.add_row("prompt tokens", f"{report.prompt_tokens:,}")
    else:
        n = len(report.chunks)
        final = report.settings.get("final_step") or {}
        how = (f"{final['mode']}ed ({final['reason']})" if final.get("mode") == "select" else
               f"generated from their summaries ({final.get('reason', 'combine')})")
        table.add_row("strategy", f"map-reduce ({n} chunk{'s' if n != 1 else ''}, then the "
                                  f"final summary, {how})")
        table.add_row("prompt tokens", f"{report.prompt_tokens:,} in the chunk prompts (the "
                                       "combine prompts depend on the chunk summaries)")
        for chunk in report.chunks:
            table.add_row(f"  {chunk['label']}", f"{chunk['prompt_tokens']:,} prompt + "
                                                 f"{chunk['max_new_tokens']:,} new tokens")
    table.add_row("attention", f"{attention['attention']} ({attention['reason']})")
    prompt, new = report.peak_generation
    table.add_row("memory planned for", f"{prompt:,} prompt + {new:,} new tokens (the largest "
                                        "generation of the run)")
    return table


__all__ = ["plan_for_document", "attention_choice", "document_json", "document_table"]
