"""PDF ingestion through pypdf: pages → text with `[page N]` markers → `Document(kind="pdf")`.

This module is the boundary between pypdf and the product, so every pypdf failure becomes an
`InputError` here (pypdf raises many exception types on hostile input — PdfReadError,
PdfStreamError, ValueError, KeyError, RecursionError, … — so the catch is deliberately broad).
Guards against hostile files: a size limit checked before pypdf sees the file (which pypdf
would read whole into memory), a page-count limit checked before any page is parsed, and a
wall-clock limit. In the main thread of a Unix process whose SIGALRM is unused, the clock
interrupts pypdf itself (a timer signal), so one page or a broken cross-reference table that
never ends is stopped too, except inside one long C call (zlib); elsewhere (other threads)
it is checked before every page and bounds the total of many slow pages.

Text layout: each page with text becomes
    [page 3]
    <page text>
and a `Section("page 3", start, end)` covering the marker and the text. Pages without
extractable text are listed in `Document.skipped`; a PDF with none at all needs OCR when its
pages hold images (scanned), else it simply has no text to read.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import threading
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


class _ParseTimeout(BaseException):
    """Raised by the SIGALRM handler inside pypdf; a BaseException so that pypdf's broad
    `except Exception` handlers cannot swallow it."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _ParseTimeout in this thread after `seconds`, where a timer signal can be used
    (the main thread, SIGALRM not taken by someone else); otherwise do nothing."""
    usable = (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
              and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None))
    if not usable:
        yield
        return

    armed = True

    def expire(signum, frame):
        if armed:
            raise _ParseTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        while True:  # a signal landing in here must not skip putting the handler back
            try:
                armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                break
            except _ParseTimeout:
                continue


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    """The file's bytes, refused before reading when larger than `max_bytes` (and never more
    than `max_bytes` + 1 read, should it grow meanwhile)."""
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            data = handle.read(max_bytes + 1) if size <= max_bytes else b""
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}",
                         hint="check the path and its permissions") from None
    if size > max_bytes or len(data) > max_bytes:
        raise InputError(f"{path} is {max(size, len(data)):,} bytes, more than the PDF size "
                         f"limit of {max_bytes:,} bytes",
                         hint="split the PDF into smaller parts (e.g. `qpdf --split-pages`)")
    return data


def _has_images(page) -> bool:
    """Whether a page draws images (XObject or inline); True when pypdf cannot tell."""
    try:
        return len(page.images) > 0
    except Exception:  # noqa: BLE001 - undecidable: keep the OCR advice
        return True


def _corrupt(path: Path | str, exc: BaseException) -> InputError:
    reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return InputError(f"{path} is not a readable PDF (corrupt or truncated): {reason}",
                      hint="re-export or re-download the PDF and try again")


def _open(path: str, data: bytes, password: str | None):
    from pypdf import PdfReader  # heavy-ish import, only when a PDF is read
    from pypdf.errors import DependencyError

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        encrypted = reader.is_encrypted
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


def _title(reader, path: str) -> str:
    try:
        meta = reader.metadata
        title = (meta.title or "").strip() if meta is not None else ""
    except Exception:  # noqa: BLE001 - metadata is optional decoration
        title = ""
    return title or Path(path).stem


def _clean(page_text: str) -> str:
    lines = page_text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip("\n")


def load_pdf(path: Path, *, password: str | None, max_pages: int, timeout_s: float,
             max_chars: int, max_bytes: int) -> Document:
    """Extract a PDF's text page by page (reading order as pypdf gives it).

    Raises InputError when the file is larger than `max_bytes`, corrupt, encrypted without
    (or with a wrong) password, has more than `max_pages` pages, takes longer than
    `timeout_s` seconds, has more than `max_chars` characters of text, or has no
    extractable text (scanned, or blank).
    """
    started = time.monotonic()
    data = _read_bounded(path, max_bytes)
    return pdf_document(data, source=str(path), password=password, max_pages=max_pages,
                        timeout_s=timeout_s, max_chars=max_chars, started=started)


def pdf_document(data: bytes, *, source: str, password: str | None, max_pages: int,
                 timeout_s: float, max_chars: int, started: float | None = None) -> Document:
    """`load_pdf` for the bytes of a PDF already read (a file's, stdin's, a collection
    member's); `source` names it in messages and its stem is the fallback title. The clock
    runs from `started` (time.monotonic(); default: now)."""
    started = time.monotonic() if started is None else started
    try:
        with _deadline(max(timeout_s - (time.monotonic() - started), 1e-6)):
            return _extract(source, data, password, max_pages, timeout_s, max_chars, started)
    except _ParseTimeout:
        raise InputError(f"reading {source} took longer than {timeout_s:g} s (stopped while "
                         "pypdf was parsing it)",
                         hint="the PDF may be malformed; re-export it or split it") from None


def _extract(path: str, data: bytes, password: str | None, max_pages: int,
             timeout_s: float, max_chars: int, started: float) -> Document:
    with _quiet_pypdf():
        reader, encrypted = _open(path, data, password)
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
        image_pages = 0
        for index in range(n_pages):
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                raise InputError(f"reading {path} took longer than {timeout_s:g} s "
                                 f"(stopped before page {index + 1} of {n_pages})",
                                 hint="the PDF may be malformed; re-export it or split it")
            label = f"page {index + 1}"
            try:
                page = reader.pages[index]
                text = _clean(page.extract_text() or "")
            except Exception as exc:  # noqa: BLE001
                skipped.append((label, f"text extraction failed: {type(exc).__name__}"))
                continue
            if not text.strip():
                image_only = _has_images(page)
                image_pages += image_only
                skipped.append((label, "no extractable text (image-only page?)" if image_only
                                else "no extractable text (no images either)"))
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
        if not image_pages:
            raise InputError(f"{path} has no extractable text (its pages hold neither text "
                             "nor images)", hint="check that this is the right PDF; text "
                             "drawn as vector shapes needs OCR (`ocrmypdf --force-ocr`)")
        raise InputError(f"{path} has no extractable text; it looks scanned (image-only), "
                         "so OCR is needed",
                         hint="run OCR first (e.g. `ocrmypdf in.pdf out.pdf`) and summarize "
                              "the result")
    return Document(text="".join(parts), kind="pdf", source=path,
                    sections=tuple(sections), skipped=tuple(skipped), title=title,
                    meta={"pages": n_pages, "encrypted": encrypted, "bytes": len(data)})


__all__ = ["load_pdf", "pdf_document"]
