"""Plain-text ingestion: bytes → decoded text → `Document(kind="text")`.

Owns the byte-level decisions shared with the repository reader:
  * `looks_binary(head)`: NUL bytes, or more than 10 % control characters, in the first
    8 KiB mean "binary" (git's rule plus a control-character ratio for NUL-free blobs).
  * `decode_bytes(data)`: a BOM decides first (UTF-8, UTF-16 LE/BE, UTF-32 LE/BE); without
    one, strict UTF-8, then strict cp1252, then latin-1 (which never fails). Newlines are
    normalised to "\\n". UTF-16 without a BOM is full of NUL bytes and is refused as binary.
Markdown and every other text format are read as text; no markup is interpreted (HTML goes to
webpage.py, .docx to docx.py). `text_document` makes the Document from bytes already read (a
file's, stdin's, a collection member's).
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


def markdown_title(text: str) -> str:
    """The text of a first non-blank line that is a `# ` heading, else ""."""
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
    return text_document(data, source=str(path), name=path.name, max_chars=max_chars)


def text_document(data: bytes, *, source: str, name: str, max_chars: int,
                  title: str = "") -> Document:
    """The bytes of one text document (a file's, stdin's) → a single-section Document.
    `name` labels the section and, without a title (given, or a Markdown file's first
    `# ` heading), gives the title (its stem). InputError for binary, empty or too-long
    text."""
    if len(data) > 4 * max_chars + 4:
        raise _too_long(source, max_chars)
    suffix = Path(name).suffix.lower()
    if looks_binary(data[:SNIFF_BYTES]):
        raise InputError(f"{source} looks like a binary file, not text", hint=(
            _OLD_FORMATS[suffix] if suffix in _OLD_FORMATS else
            "give a PDF, a .docx, an .html, a text/Markdown file, or a folder"))
    text, encoding = decode_bytes(data)
    if not text.strip():
        raise InputError(f"{source} is empty", hint="give a file that contains text")
    if len(text) > max_chars:
        raise _too_long(source, max_chars)
    if not title and suffix in (".md", ".markdown"):
        title = markdown_title(text)
    return Document(text=text, kind="text", source=source,
                    sections=(Section(label=name, start=0, end=len(text), bytes=len(data)),),
                    title=title or Path(name).stem,
                    meta={"encoding": encoding, "bytes": len(data)})


_OLD_FORMATS = {  # binary formats people expect to work: say how to convert them
    ".doc": "the old Word format (.doc) is not read: save it as .docx (or PDF) and try again",
    ".odt": "OpenDocument text is not read: save it as .docx (or PDF) and try again",
    ".rtf": "save the document as .docx, PDF or plain text and try again",
}


def _too_long(path: Path | str, max_chars: int) -> InputError:
    return InputError(f"{path} is longer than the limit of {max_chars:,} characters",
                      hint="split the document into parts and summarize them separately")


__all__ = ["looks_binary", "decode_bytes", "bom_encoding", "load_text", "text_document",
           "markdown_title",
           "SNIFF_BYTES"]
