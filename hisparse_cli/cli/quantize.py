"""`hisparse quantize MODEL --out DIR`: AWQ INT4 quantization, calibrated on your documents.

A thin wrapper over `hisparse_cli.quantize.api.quantize_model`. MODEL is anything `--model`
accepts (registry name, HF folder, .gguf file). Calibration documents are read like
`summarize` reads them (PDF, text, a repository folder); without --calib the repository's
samples/ are used. stdout gets the output folder (or the report as JSON with --json);
progress and the report table go to stderr.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Annotated, List, Optional

import typer


class Method(str, Enum):
    awq = "awq"
    rtn = "rtn"


class Device(str, Enum):
    cuda = "cuda"
    cpu = "cpu"


class GroupSize(str, Enum):  # model.awq.SUPPORTED_GROUP_SIZES, as choices --help shows
    g32 = "32"
    g64 = "64"
    g128 = "128"


def _calibration_texts(paths: list[Path] | None, password: str | None) -> list[str]:
    if not paths:
        from hisparse_cli.quantize.calibration import default_calibration_texts

        return default_calibration_texts()
    from hisparse_cli.documents import load_document

    return [load_document(p, password=password).text for p in paths]


def quantize(
    model: Annotated[str, typer.Argument(
        help="Model to quantize: registry name, HF folder (fp16/bf16) or .gguf file.",
        show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="New folder for the INT4 model.")],
    calib: Annotated[Optional[List[Path]], typer.Option(
        "--calib", readable=False,  # an unreadable file: the loader's one-line exit 3
        help="Calibration document (PDF, text, folder); repeat for more.  "
             "[default: samples/]")] = None,
    group_size: Annotated[Optional[GroupSize], typer.Option(
        "--group-size", help="Weights per quantization group.  [default: 128, or the largest "
                             "of 64 / 32 that divides the model]",
        show_default=False)] = None,
    samples: Annotated[int, typer.Option("--samples", min=1,
                                         help="Calibration blocks at most.")] = 128,
    seq_len: Annotated[int, typer.Option("--seq-len", min=2,
                                         help="Tokens per calibration block.")] = 512,
    method: Annotated[Method, typer.Option(
        "--method", help="awq (scale + clip search) or rtn (round-to-nearest baseline).")
    ] = Method.awq,
    quantize_lm_head: Annotated[bool, typer.Option(
        "--quantize-lm-head", help="Also quantize the output head.")] = False,
    device: Annotated[Optional[Device], typer.Option(
        "--device", help="Where layers are calibrated.  [default: cuda if available]",
        show_default=False)] = None,
    password: Annotated[Optional[str], typer.Option(
        "--password", help="Password of encrypted calibration PDFs.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
) -> None:
    """Quantize a model's linear layers to AWQ INT4 (GEMM layout) into a new folder."""
    from rich.table import Table

    from hisparse_cli.console import TokenProgress, print_table, stderr_console, write_result
    from hisparse_cli.hub import resolve_model
    from hisparse_cli.quantize.api import check_destination, quantize_model

    check_destination(out, device.value if device else None)  # before reading anything
    texts = _calibration_texts(calib, password)
    source = resolve_model(model, progress=None if quiet else stderr_console())
    with TokenProgress(quiet=quiet) as bars:
        report = quantize_model(
            source, out, calib_texts=texts,
            group_size=int(group_size.value) if group_size else None, n_samples=samples,
            seq_len=seq_len, method=method.value, quantize_lm_head=quantize_lm_head,
            device=device.value if device else None, progress=lambda stage, done, total: bars("quantize", stage, done,
                                                                    total))
    data = {**asdict(report), "loss_ratio": report.loss_ratio, "source": str(source)}
    write_result(json.dumps(data, indent=2, default=str) if as_json else str(report.out_dir))
    if not quiet:
        table = Table(title=f"hisparse quantize → {report.out_dir}", show_header=False,
                      title_justify="left")
        for name, value in (("method", report.method), ("group size", str(report.group_size)),
                            ("calibration", f"{report.n_samples} blocks, "
                                            f"{report.calib_tokens:,} tokens"),
                            ("INT4 modules", str(len(report.quantized))),
                            ("kept in fp16", ", ".join(report.kept_fp) or "none"),
                            ("AWQ/RTN loss", "n/a" if report.loss_ratio is None
                             else f"{report.loss_ratio:.3f}"),
                            ("size", f"{report.size_bytes / 2**20:,.1f} MiB"),
                            ("time", f"{report.seconds:.1f} s")):
            table.add_row(name, value)
        print_table(table)


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)
