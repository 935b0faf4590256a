"""GGUF file → HF-style model folder (config.json, model.safetensors, tokenizer, provenance).

The conversion uses transformers' own GGUF reader (tokenizer and dequantized weights), then
`save_pretrained`. It is done once per model and written atomically: everything goes into a
staging folder beside the destination, `hisparse.json` is written last, and one `os.replace`
publishes the folder, so a crash or Ctrl-C never leaves a folder that looks complete.

Weights are stored as float16 when every tensor fits its range (GGUF Q4_1/Q8_0 dequantize to
float32 values that float16 rounds at ~2^-11 relative; measured on SmolLM2-135M: logits move
by < 0.05 on a logit std of ~8, argmax unchanged), else float32. Nothing here reaches the
network (`local_files_only=True`, the GGUF is passed by absolute path and the "repository"
is an empty folder), and `trust_remote_code` is never set.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hisparse_cli.errors import ModelError
from hisparse_cli.hub.progress import Reporter
from hisparse_cli.hub.registry import PROVENANCE_FILE

CONVERTER_FORMAT = 1  # bump when the folder layout or dtype policy changes
_DROP_TOKENIZER_KEYS = ("is_local", "local_files_only", "_commit_hash")


def read_gguf_chat_template(gguf: Path) -> str | None:
    """The `tokenizer.chat_template` string stored in a GGUF's metadata, or None."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).get_field("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) and value else None


def _versions() -> dict[str, str]:
    from hisparse_cli import __version__

    found = {"hisparse": __version__}
    for dist in ("transformers", "torch", "gguf", "safetensors", "tokenizers"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "absent"
    return found


def _load_tokenizer(gguf: Path, empty_repo: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(empty_repo), gguf_file=str(gguf), local_files_only=True)
    if not tokenizer.chat_template:  # older transformers drop it; the GGUF still has it
        template = read_gguf_chat_template(gguf)
        if template:
            tokenizer.chat_template = template
    return tokenizer


def _load_model(gguf: Path, empty_repo: Path) -> Any:
    import torch
    import transformers

    if importlib.util.find_spec("accelerate") is None:
        raise ModelError(
            "converting a GGUF file needs the `accelerate` package (transformers requires it)",
            hint="pip install accelerate",
        )
    extra: dict[str, Any] = {}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:  # newer transformers may keep GGUF blocks packed: ask for plain weights
        extra["quantization_config"] = gguf_config(gguf_file=str(gguf), dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(empty_repo), gguf_file=str(gguf), dtype=torch.float32, local_files_only=True, **extra
    )
    if getattr(model, "hf_quantizer", None) is not None:
        raise ModelError(
            f"transformers kept {gguf.name} quantized instead of dequantizing it",
            hint="this transformers version is not supported for GGUF conversion; report it",
        )
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def storage_dtype(model: Any) -> Any:
    """float16 when every floating tensor fits float16's finite range, else float32."""
    import torch

    limit = torch.finfo(torch.float16).max
    for tensor in model.state_dict().values():
        if tensor.is_floating_point() and tensor.numel() and tensor.abs().max().item() > limit:
            return torch.float32
    return torch.float16


def _fix_tokenizer_files(out: Path, tokenizer: Any) -> None:
    """Keep the chat template in tokenizer_config.json, name a class every transformers knows,
    drop load-time keys, and write special_tokens_map.json."""
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key in _DROP_TOKENIZER_KEYS:
        config.pop(key, None)
    jinja = out / "chat_template.jinja"
    if "chat_template" not in config and jinja.is_file():
        config["chat_template"] = jinja.read_text(encoding="utf-8")
    jinja.unlink(missing_ok=True)
    if config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        config["tokenizer_class"] = "PreTrainedTokenizerFast"  # loads tokenizer.json verbatim
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    special = {k: str(v) for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")


@contextmanager
def _quiet_transformers(reporter: Reporter) -> Iterator[None]:
    """Hide transformers' own tqdm bars (weight loading, shard writing) while converting, and
    route the GGUF dequantization loop (a plain tqdm that transformers does not let us
    switch off) through `reporter.iterate`: a bar on a terminal, a line at most every ~10 s
    in a log, nothing when quiet."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    def gguf_tqdm(iterable=None, *args, **kwargs):
        return reporter.iterate(iterable if iterable is not None else (),
                                "dequantizing GGUF tensors", total=kwargs.get("total"))

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = gguf_tqdm
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()


def convert_into(gguf: Path, out: Path, reporter: Reporter) -> dict[str, Any]:
    """Write config, safetensors and tokenizer for `gguf` into the existing folder `out`.
    Returns facts for the provenance file."""
    with _quiet_transformers(reporter):
        return _convert_into(gguf, out, reporter)


def _convert_into(gguf: Path, out: Path, reporter: Reporter) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=".empty-", dir=out.parent) as empty:
        with reporter.step(f"reading the tokenizer from {gguf.name}"):
            tokenizer = _load_tokenizer(gguf, Path(empty))
        with reporter.step(f"dequantizing the weights of {gguf.name}"):
            model = _load_model(gguf, Path(empty))
    dtype = storage_dtype(model)
    model.to(dtype)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions:
        tokenizer.model_max_length = int(max_positions)
    with reporter.step(f"writing {str(dtype).removeprefix('torch.')} safetensors"):
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out), save_jinja_files=False)
        _fix_tokenizer_files(out, tokenizer)
    if not tokenizer.chat_template:
        reporter.note(f"{gguf.name} has no chat template; prompts will be plain text")
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "model_type": model.config.model_type,
        "has_chat_template": bool(tokenizer.chat_template),
    }


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish(staging: Path, dest: Path, *, replace: bool) -> None:
    """Move the finished `staging` folder to `dest` in one rename (with umask permissions:
    mkdtemp and transformers create private 0o700/0o600 entries)."""
    mask = _current_umask()
    staging.chmod(0o777 & ~mask)
    for entry in staging.iterdir():
        if entry.is_file():
            entry.chmod(0o666 & ~mask)
    if dest.exists() and replace:
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, old / dest.name)
        os.replace(staging, dest)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.replace(staging, dest)
    except OSError:
        if not (dest / PROVENANCE_FILE).is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)  # another process finished first: keep theirs


def convert_gguf(
    gguf: Path,
    dest: Path,
    *,
    source: dict[str, Any],
    reporter: Reporter | None = None,
    replace: bool = False,
) -> Path:
    """Convert `gguf` into the folder `dest` atomically; `source` goes into hisparse.json.

    With `replace=False` an already finished `dest` is returned untouched."""
    reporter = reporter or Reporter()
    if (dest / PROVENANCE_FILE).is_file() and not replace:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    started = time.monotonic()
    try:
        try:
            facts = convert_into(gguf, staging, reporter)
        except (ModelError, KeyboardInterrupt, MemoryError):
            raise
        except Exception as exc:  # transformers' errors: unsupported architecture, bad file, ...
            raise ModelError(
                f"cannot convert {gguf.name}: {type(exc).__name__}: {exc}",
                hint="a truncated or corrupt download: fetch the file again; otherwise "
                     "hisparse converts only Llama-family GGUF files that transformers can read",
            ) from exc
        provenance = {
            "format": CONVERTER_FORMAT,
            "source": source,
            "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "conversion_seconds": round(time.monotonic() - started, 1),
            "converter": _versions(),
            **facts,
        }
        text = json.dumps(provenance, indent=2) + "\n"
        (staging / PROVENANCE_FILE).write_text(text, encoding="utf-8")  # written last
        _publish(staging, dest, replace=replace)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest
