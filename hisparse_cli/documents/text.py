"""Plain-text ingestion: bytes → decoded text → `Document(kind="text")`.

Owns the byte-level decisions shared with the repository reader:
  * `looks_binary(head)`: NUL bytes, or more than 10 % control characters, in the first
    8 KiB mean "binary" (git's rule plus a control-character ratio for NUL-free blobs).
  * `decode_bytes(data)`: a BOM decides first (UTF-8, UTF-16 LE/BE, UTF-32 LE/BE); without
    one, strict UTF-8, then strict cp1252, then latin-1 (which never fails). Newlines are
    normalised to "\\n". UTF-16 without a BOM is full of NUL bytes and is refused as binary.
Markdown and every other text format are read as text; no markup is interpreted.
"""

from __future__ import annotations

import codecs
import os
from pathlib import Path

from hisparse_cli.documents.base import Document, Section
from hisparse_cli.errors import InputError

SNIFF_BYTES = 8192
CONTROL_RATIO_LIMIT = 0.10
# Control bytes that do occur in real text: \b \t \n \v \f \r and ESC (ANSI colour in logs).
_TEXT_CONTROLS = frozenset(b"\b\t\n\v\f\r\x1b")
_BOMS = (  # longest first: the UTF-32 LE BOM starts with the UTF-16 LE one
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_FALLBACK_ENCODINGS = ("utf-8", "cp1252", "latin-1")


def bom_encoding(data: bytes) -> str | None:
    """The codec named by a leading byte-order mark, or None."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return encoding
    return None


def looks_binary(head: bytes) -> bool:
    """True for bytes that are not text: a NUL, or > 10 % control characters.

    Call it with the first `SNIFF_BYTES` of a file. Text with a UTF-16/32 BOM is not binary
    even though it contains NUL bytes.
    """
    if not head or bom_encoding(head) is not None:
        return False
    head = head[:SNIFF_BYTES]
    if b"\x00" in head:
        return True
    controls = sum(1 for b in head if (b < 0x20 or b == 0x7F) and b not in _TEXT_CONTROLS)
    return controls / len(head) > CONTROL_RATIO_LIMIT


def decode_bytes(data: bytes) -> tuple[str, str]:
    """Decode text bytes; returns (text with "\\n" newlines, encoding used)."""
    encoding = bom_encoding(data)
    if encoding is not None:
        try:
            text = data.decode(encoding)
        except UnicodeDecodeError as exc:
            raise InputError(f"text starts with a {encoding} byte-order mark but does not "
                             f"decode as {encoding}: {exc.reason}",
                             hint="re-save the file as UTF-8") from None
        text = text.lstrip("\ufeff")
    else:
        for encoding in _FALLBACK_ENCODINGS:
            try:
                text = data.decode(encoding)
                break
            except UnicodeDecodeError:
                continue
    return text.replace("\r\n", "\n").replace("\r", "\n"), encoding


def _markdown_title(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.lstrip("#").strip() if line.startswith("# ") else ""
    return ""


def load_text(path: Path, *, max_chars: int) -> Document:
    """Read one text file (any encoding `decode_bytes` handles) as a single-section Document.

    Raises InputError for a missing/unreadable file, a binary file, an empty (or
    whitespace-only) file, or one longer than `max_chars` characters.
    """
    max_bytes = 4 * max_chars + 4  # no encoding needs more than 4 bytes per character
    try:
        with path.open("rb") as handle:
            if os.fstat(handle.fileno()).st_size > max_bytes:
                raise _too_long(path, max_chars)
            data = handle.read(max_bytes + 1)  # bounded, should the file grow meanwhile
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}",
                         hint="check the path and its permissions") from None
    if len(data) > max_bytes:
        raise _too_long(path, max_chars)
    if looks_binary(data[:SNIFF_BYTES]):
        raise InputError(f"{path} looks like a binary file, not text",
                         hint="give a PDF, a text/Markdown file, or a source directory")
    text, encoding = decode_bytes(data)
    if not text.strip():
        raise InputError(f"{path} is empty", hint="give a file that contains text")
    if len(text) > max_chars:
        raise _too_long(path, max_chars)
    title = (_markdown_title(text) if path.suffix.lower() in (".md", ".markdown") else "")
    return Document(text=text, kind="text", source=str(path),
                    sections=(Section(label=path.name, start=0, end=len(text)),),
                    title=title or path.stem, meta={"encoding": encoding, "bytes": len(data)})


def _too_long(path: Path, max_chars: int) -> InputError:
    return InputError(f"{path} is longer than the limit of {max_chars:,} characters",
                      hint="split the document into parts and summarize them separately")


__all__ = ["looks_binary", "decode_bytes", "bom_encoding", "load_text", "SNIFF_BYTES"]
