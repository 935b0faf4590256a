"""PDF ingestion through pypdf: pages → text with `[page N]` markers → `Document(kind="pdf")`.

This module is the boundary between pypdf and the product, so every pypdf failure becomes an
`InputError` here (pypdf raises many exception types on hostile input — PdfReadError,
PdfStreamError, ValueError, KeyError, RecursionError, … — so the catch is deliberately broad).
Guards against hostile files: a page-count limit checked before any page is parsed, and a
wall-clock limit checked before every page. The clock cannot interrupt a single page whose
parsing never ends; it bounds the total of many slow pages.

Text layout: each page with text becomes
    [page 3]
    <page text>
and a `Section("page 3", start, end)` covering the marker and the text. Pages without
extractable text are listed in `Document.skipped`; a PDF with none at all needs OCR.
"""

from __future__ import annotations

import logging
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hisparse_cli.documents.base import Document, Section
from hisparse_cli.errors import InputError

_PASSWORD_HINT = "pass the password with --password"


@contextmanager
def _quiet_pypdf() -> Iterator[None]:
    """Silence pypdf's logger and warnings for the duration (restored afterwards)."""
    logger = logging.getLogger("pypdf")
    previous = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(previous)


def _corrupt(path: Path, exc: BaseException) -> InputError:
    reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return InputError(f"{path} is not a readable PDF (corrupt or truncated): {reason}",
                      hint="re-export or re-download the PDF and try again")


def _open(path: Path, password: str | None):
    from pypdf import PdfReader  # heavy-ish import, only when a PDF is read
    from pypdf.errors import DependencyError

    try:
        reader = PdfReader(str(path), strict=False)
        encrypted = reader.is_encrypted
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}",
                         hint="check the path and its permissions") from None
    except Exception as exc:  # noqa: BLE001 - boundary: pypdf raises many types
        raise _corrupt(path, exc) from None
    if not encrypted:
        return reader, False
    try:
        # An empty user password is common (owner-only restrictions): open those silently.
        ok = reader.decrypt(password if password is not None else "")
    except DependencyError as exc:
        raise InputError(f"{path} uses an encryption pypdf cannot open without an extra "
                         f"package: {exc}", hint="pip install cryptography") from None
    except Exception as exc:  # noqa: BLE001
        raise _corrupt(path, exc) from None
    if not ok:
        if password is None:
            raise InputError(f"{path} is encrypted", hint=_PASSWORD_HINT)
        raise InputError(f"wrong password for encrypted PDF {path}",
                         hint="check the value given to --password")
    return reader, True


def _title(reader, path: Path) -> str:
    try:
        meta = reader.metadata
        title = (meta.title or "").strip() if meta is not None else ""
    except Exception:  # noqa: BLE001 - metadata is optional decoration
        title = ""
    return title or path.stem


def _clean(page_text: str) -> str:
    lines = page_text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip("\n")


def load_pdf(path: Path, *, password: str | None, max_pages: int, timeout_s: float,
             max_chars: int) -> Document:
    """Extract a PDF's text page by page (reading order as pypdf gives it).

    Raises InputError when the file is corrupt, encrypted without (or with a wrong)
    password, has more than `max_pages` pages, takes longer than `timeout_s` seconds, has
    more than `max_chars` characters of text, or has no extractable text (scanned).
    """
    started = time.monotonic()
    with _quiet_pypdf():
        reader, encrypted = _open(path, password)
        try:
            n_pages = len(reader.pages)
        except Exception as exc:  # noqa: BLE001
            raise _corrupt(path, exc) from None
        if n_pages == 0:
            raise InputError(f"{path} has no pages", hint="check that the PDF is complete")
        if n_pages > max_pages:
            raise InputError(f"{path} has {n_pages:,} pages, more than the limit of {max_pages:,}",
                             hint="split the PDF into smaller parts")
        parts: list[str] = []
        sections: list[Section] = []
        skipped: list[tuple[str, str]] = []
        offset = 0
        for index in range(n_pages):
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                raise InputError(f"reading {path} took longer than {timeout_s:g} s "
                                 f"(stopped before page {index + 1} of {n_pages})",
                                 hint="the PDF may be malformed; re-export it or split it")
            label = f"page {index + 1}"
            try:
                text = _clean(reader.pages[index].extract_text() or "")
            except Exception as exc:  # noqa: BLE001
                skipped.append((label, f"text extraction failed: {type(exc).__name__}"))
                continue
            if not text.strip():
                skipped.append((label, "no extractable text (image-only page?)"))
                continue
            block = f"[{label}]\n{text}\n"
            if parts:
                block = "\n" + block
            sections.append(Section(label=label, start=offset + (1 if parts else 0),
                                    end=offset + len(block)))
            parts.append(block)
            offset += len(block)
            if offset > max_chars:
                raise InputError(f"{path} has more than the limit of {max_chars:,} characters "
                                 "of text", hint="split the PDF into smaller parts")
        title = _title(reader, path)
    if not sections:
        if len(skipped) == n_pages and all("failed" in reason for _, reason in skipped):
            raise InputError(f"{path} is not a readable PDF: text extraction failed on every "
                             "page", hint="re-export or re-download the PDF and try again")
        raise InputError(f"{path} has no extractable text; it looks scanned (image-only), "
                         "so OCR is needed",
                         hint="run OCR first (e.g. `ocrmypdf in.pdf out.pdf`) and summarize "
                              "the result")
    return Document(text="".join(parts), kind="pdf", source=str(path),
                    sections=tuple(sections), skipped=tuple(skipped), title=title,
                    meta={"pages": n_pages, "encrypted": encrypted})


__all__ = ["load_pdf"]
