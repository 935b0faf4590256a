"""Calibration data for `hisparse quantize`: the user's own documents as token blocks.

Texts are tokenized as inference tokenizes them (the tokenizer's own special tokens), joined,
and cut into blocks of `seq_len` tokens; when there are more blocks than `n_samples`, evenly
spaced ones are kept so the whole corpus is represented. The default corpus is the repository's
`samples/` folder (documents we wrote ourselves), read as plain text.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hisparse_cli.errors import ConfigError, InputError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".toml", ".json", ".yaml", ".yml", ".c", ".h",
                 ".rs", ".go", ".js", ".ts", ".java", ".html", ".csv")


def samples_folder() -> Path:
    """The repository's samples/ folder (a source checkout; not part of the wheel)."""
    return Path(__file__).resolve().parents[2] / "samples"


def read_texts(paths: list[str | Path]) -> list[str]:
    """Plain-text files (folders are walked for TEXT_SUFFIXES files) -> their texts, in order."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise InputError(f"calibration file not found: {p}")
    texts = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read calibration file {f} as UTF-8 text: {exc}") from exc
        if text.strip():
            texts.append(text)
    return texts


def default_calibration_texts() -> list[str]:
    folder = samples_folder()
    if not folder.is_dir():
        raise InputError("no samples/ folder to calibrate on (installed without the repository)",
                         hint="pass your own documents with --calib FILE ...")
    return read_texts([folder])


def calibration_blocks(tokenizer, texts: list[str], n_samples: int, seq_len: int
                       ) -> list[torch.Tensor]:
    """Texts -> at most n_samples int64 blocks [seq_len] (one shorter block if text is short)."""
    if n_samples < 1 or seq_len < 2:
        raise ConfigError(f"samples must be >= 1 and seq_len >= 2, got {n_samples}, {seq_len}")
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=True)["input_ids"]
    if len(ids) < 2:
        raise InputError("the calibration documents contain no text",
                         hint="pass documents with text in them via --calib")
    n_blocks = len(ids) // seq_len
    if n_blocks == 0:
        return [torch.tensor(ids, dtype=torch.long)]
    keep = min(n_samples, n_blocks)
    starts = torch.linspace(0, n_blocks - 1, keep).round().long().unique().tolist()
    return [torch.tensor(ids[b * seq_len:(b + 1) * seq_len], dtype=torch.long) for b in starts]
