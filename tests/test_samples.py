"""The shipped samples: the hand-made PDF is valid and reproducible and extracts to exactly its
source text; every sample loads with the right kind/genre; references are short and invent
no numbers; the folder stays small."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from pypdf import PdfReader

from hisparse_cli.documents import load_document
from hisparse_cli.scoring import rouge_scores, split_sentences

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
CONTRACT_TXT = SAMPLES / "contract" / "services_agreement.txt"
CONTRACT_PDF = SAMPLES / "contract" / "services_agreement.pdf"
MEDICAL = SAMPLES / "medical" / "discharge_report.txt"
TINYKV = SAMPLES / "repo" / "tinykv"

_spec = importlib.util.spec_from_file_location("make_contract_pdf",
                                               SAMPLES / "make_contract_pdf.py")
make_pdf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_pdf)

CASES = [  # (document, reference)
    (CONTRACT_PDF, SAMPLES / "contract" / "services_agreement.ref.txt"),
    (MEDICAL, SAMPLES / "medical" / "discharge_report.ref.txt"),
    (TINYKV, SAMPLES / "repo" / "tinykv.ref.txt"),
]


def test_committed_pdf_is_reproduced_by_the_script():
    text = CONTRACT_TXT.read_text(encoding="utf-8")
    assert make_pdf.build_pdf(text, title="Master Services Agreement") == CONTRACT_PDF.read_bytes()


def test_pdf_structure_is_valid():
    data = CONTRACT_PDF.read_bytes()
    reader = PdfReader(CONTRACT_PDF, strict=True)  # strict: a bad xref would raise
    assert 2 <= len(reader.pages) <= 3
    start = int(re.search(rb"startxref\n(\d+)\n%%EOF\n$", data).group(1))
    assert data[start:start + 4] == b"xref"
    entries = re.findall(rb"(\d{10}) 00000 n \n", data[start:])
    for number, offset in enumerate(entries, start=1):  # every offset lands on its object
        assert data[int(offset):].startswith(f"{number} 0 obj".encode())
    for page in reader.pages:  # nothing drawn outside the 3/4-inch margins
        for line in (page.extract_text() or "").splitlines():
            assert make_pdf.text_width(line) <= 612 - 2 * 54 + 1e-6


def test_pdf_extracts_to_exactly_the_source_words():
    doc = load_document(CONTRACT_PDF)
    assert doc.kind == "pdf" and doc.genre == "contract" and doc.title == "Master Services Agreement"
    assert [s.label for s in doc.sections] == [f"page {i}" for i in range(1, doc.meta["pages"] + 1)]
    body = re.sub(r"^\[page \d+\]$", "", doc.text, flags=re.MULTILINE)
    assert body.split() == CONTRACT_TXT.read_text(encoding="utf-8").split()


def test_medical_report_loads_as_a_clinical_text():
    doc = load_document(MEDICAL)
    assert doc.kind == "text" and doc.genre == "clinical"
    assert 1300 <= len(doc.text.split()) <= 1700


def test_tinykv_repository():
    doc = load_document(TINYKV)
    labels = [s.label for s in doc.sections]
    assert labels == ["README.md", "pyproject.toml", "tinykv/__init__.py", "tinykv/cli.py",
                      "tinykv/store.py", "tinykv/wal.py", ".gitignore"]
    assert doc.kind == "repository" and doc.genre == "code"
    assert not [item for item, _ in doc.skipped if not item.endswith("__pycache__/")]


@pytest.mark.parametrize("document, reference", CASES, ids=["contract", "medical", "tinykv"])
def test_references_are_short_and_grounded(document, reference):
    ref = reference.read_text(encoding="utf-8")
    assert 4 <= len(split_sentences(ref)) <= 6
    source = load_document(document).text
    numbers = set(re.findall(r"\d+(?:[.,]\d+)*", ref))
    plain = source.replace(",", "")
    for number in numbers:  # a reference must not invent a figure
        assert number in source or number.replace(",", "") in plain, number
    assert rouge_scores(ref, source)["rouge1"] > 0.05  # about this document, not another


def test_samples_are_small_and_ours():
    files = [p for p in SAMPLES.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sum(p.stat().st_size for p in files) < 200_000
    for path in files:
        if path.suffix in (".txt", ".md", ".py"):
            assert "Copyright" not in path.read_text(encoding="utf-8"), path
