"""Write samples/contract/services_agreement.pdf from services_agreement.txt, by hand.

No dependency: the PDF is assembled byte by byte (PDF 1.4, one Helvetica Type1 font with
WinAnsiEncoding, US Letter pages, 10 pt text with 12 pt leading, 3/4-inch margins). Lines are
wrapped with Helvetica's standard glyph widths so no line runs past the right margin. The
output is deterministic (no dates, no IDs), so re-running the script reproduces the
committed file byte for byte — tests/test_samples.py checks exactly that.

Usage:  python samples/make_contract_pdf.py [SOURCE.txt [OUT.pdf]]
`build_pdf(text, title)` is importable for tests that need a known-good text PDF.
"""

from __future__ import annotations

import sys
from pathlib import Path

PAGE_W, PAGE_H = 612, 792  # US Letter in points
MARGIN = 54
FONT_SIZE = 10
LEADING = 12
LINES_PER_PAGE = (PAGE_H - 2 * MARGIN) // LEADING

# Helvetica advance widths (1/1000 em) for ASCII 32..126, from the standard AFM metrics.
_WIDTHS = [
    278, 278, 355, 556, 556, 889, 667, 191, 333, 333, 389, 584, 278, 333, 278, 278,  # sp - /
    556, 556, 556, 556, 556, 556, 556, 556, 556, 556, 278, 278, 584, 584, 584, 556,  # 0 - ?
    1015, 667, 667, 722, 722, 667, 611, 778, 722, 278, 500, 667, 556, 833, 722, 778,  # @ - O
    667, 778, 722, 667, 611, 722, 667, 944, 667, 667, 611, 278, 278, 278, 469, 556,  # P - _
    333, 556, 556, 500, 556, 556, 278, 556, 556, 222, 222, 500, 222, 833, 556, 556,  # ` - o
    556, 556, 333, 500, 278, 556, 500, 722, 500, 500, 500, 334, 260, 334, 584,  # p - ~
]


def text_width(line: str) -> float:
    """Width of `line` in points at FONT_SIZE (ASCII only)."""
    return sum(_WIDTHS[ord(c) - 32] for c in line) * FONT_SIZE / 1000


def wrap_paragraph(paragraph: str, max_width: float = PAGE_W - 2 * MARGIN) -> list[str]:
    """Greedy word wrap to `max_width` points."""
    lines: list[str] = []
    current = ""
    for word in paragraph.split():
        candidate = f"{current} {word}" if current else word
        if current and text_width(candidate) > max_width:
            lines.append(current)
            current = word
        else:
            current = candidate
    if current:
        lines.append(current)
    return lines


def layout(text: str) -> list[list[str]]:
    """Paragraphs (blank-line separated) → wrapped lines → pages of LINES_PER_PAGE lines."""
    lines: list[str] = []
    for paragraph in text.replace("\r\n", "\n").split("\n\n"):
        wrapped = wrap_paragraph(paragraph)
        if not wrapped:
            continue
        if lines and len(lines) % LINES_PER_PAGE != 0:
            lines.append("")  # blank line between paragraphs, not at the top of a page
        lines.extend(wrapped)
    return [lines[i:i + LINES_PER_PAGE] for i in range(0, len(lines), LINES_PER_PAGE)]


def _pdf_string(line: str) -> str:
    if any(not (32 <= ord(c) < 127) for c in line):
        raise ValueError(f"non-ASCII character in line: {line!r}")
    return "(" + line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") + ")"


def _content_stream(page_lines: list[str]) -> bytes:
    ops = ["BT", f"/F1 {FONT_SIZE} Tf", f"{LEADING} TL", f"{MARGIN} {PAGE_H - MARGIN} Td"]
    for i, line in enumerate(page_lines):
        if i:
            ops.append("T*")
        if line:
            ops.append(f"{_pdf_string(line)} Tj")
    ops.append("ET")
    return ("\n".join(ops) + "\n").encode("ascii")


def build_pdf(text: str, title: str = "") -> bytes:
    """A complete PDF (bytes) showing `text`, wrapped and paginated."""
    pages = layout(text)
    if not pages:
        raise ValueError("no text to lay out")
    n = len(pages)
    # Object numbers: 1 catalog, 2 page tree, 3 font, 4 info, then (page, contents) pairs.
    page_ids = [5 + 2 * i for i in range(n)]
    objects: list[bytes] = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        ("<< /Type /Pages /Kids [" + " ".join(f"{p} 0 R" for p in page_ids)
         + f"] /Count {n} >>").encode("ascii"),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
        f"<< /Title {_pdf_string(title)} /Producer (hisparse samples) >>".encode("ascii"),
    ]
    for page_id, page_lines in zip(page_ids, pages):
        stream = _content_stream(page_lines)
        objects.append((f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {PAGE_W} {PAGE_H}] "
                        f"/Resources << /Font << /F1 3 0 R >> >> /Contents {page_id + 1} 0 R >>"
                        ).encode("ascii"))
        objects.append(f"<< /Length {len(stream)} >>\nstream\n".encode("ascii") + stream
                       + b"endstream")
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")  # binary comment marks the file binary
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n".encode("ascii") + body + b"\nendobj\n"
    xref_at = len(out)
    out += f"xref\n0 {len(objects) + 1}\n".encode("ascii")
    out += b"0000000000 65535 f \n"
    for offset in offsets:
        out += f"{offset:010d} 00000 n \n".encode("ascii")  # each entry is exactly 20 bytes
    out += (f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R /Info 4 0 R >>\n"
            f"startxref\n{xref_at}\n%%EOF\n").encode("ascii")
    return bytes(out)


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent / "contract"
    source = Path(argv[1]) if len(argv) > 1 else here / "services_agreement.txt"
    target = Path(argv[2]) if len(argv) > 2 else source.with_suffix(".pdf")
    text = source.read_text(encoding="utf-8")
    title = text.strip().splitlines()[0].strip().title()
    data = build_pdf(text, title=title)
    target.write_bytes(data)
    print(f"wrote {target} ({len(data):,} bytes, {len(layout(text))} pages)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
