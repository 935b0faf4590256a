"""Ingestion: PDFs (valid, truncated, encrypted, image-only, garbage, guards), text encodings,
binary refusal, repositories (ignore rules, skips, symlinks, caps, order), genre guess."""

from __future__ import annotations

import importlib.util
import io
import shutil
import subprocess
from pathlib import Path

import pytest
from pypdf import PdfReader, PdfWriter

from hisparse_cli.documents import IngestLimits, guess_genre, load_document
from hisparse_cli.documents.genre import canonical_genre
from hisparse_cli.errors import ConfigError, InputError

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
_spec = importlib.util.spec_from_file_location("make_contract_pdf",
                                               SAMPLES / "make_contract_pdf.py")
make_pdf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_pdf)

PAGE_TEXT = "\n\n".join(f"Paragraph {i} says the quick brown fox jumps over the lazy dog."
                        for i in range(80))  # 159 lines: three pages at 57 lines per page


@pytest.fixture
def good_pdf(tmp_path) -> Path:
    path = tmp_path / "good.pdf"
    path.write_bytes(make_pdf.build_pdf(PAGE_TEXT, title="Fox Report"))
    return path


def _error(path, **kw) -> InputError:
    with pytest.raises(InputError) as info:
        load_document(path, **kw)
    assert info.value.exit_code == 3
    return info.value


# --- PDF --------------------------------------------------------------------------------------

def test_pdf_pages_markers_and_sections(good_pdf):
    doc = load_document(good_pdf)
    reader = PdfReader(good_pdf)  # oracle: pypdf page by page, without our layer
    assert doc.kind == "pdf" and doc.title == "Fox Report" and doc.meta["pages"] == 3
    assert [s.label for s in doc.sections] == ["page 1", "page 2", "page 3"]
    for section, page in zip(doc.sections, reader.pages):
        chunk = doc.text[section.start:section.end]
        assert chunk.startswith(f"[{section.label}]\n")
        assert chunk.split()[2:] == page.extract_text().split()
    assert doc.text.splitlines().count("[page 2]") == 1
    assert doc.text.split().count("Paragraph") == 80


def test_pdf_detected_by_magic_bytes_without_suffix(good_pdf, tmp_path):
    renamed = tmp_path / "report.dat"
    renamed.write_bytes(good_pdf.read_bytes())
    assert load_document(renamed).kind == "pdf"


@pytest.mark.parametrize("cut", [0.5, 0.9, 0.1])
def test_truncated_pdf_is_input_error(good_pdf, tmp_path, cut):
    data = good_pdf.read_bytes()
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(data[: int(len(data) * cut)])
    assert "PDF" in _error(broken).message


def test_garbage_with_pdf_suffix_is_input_error(tmp_path):
    junk = tmp_path / "junk.pdf"
    junk.write_bytes(bytes(range(256)) * 40)
    assert "not a readable PDF" in _error(junk).message


@pytest.mark.parametrize("name, head", [("notes.txt", b"%PDF"), ("notes.md", b"\xef\xbb\xbf%PDF"),
                                        ("notes.TXT", b"  %PDF")])
def test_text_suffix_is_read_as_text_even_when_it_starts_with_pdf(tmp_path, name, head):
    path = tmp_path / name
    path.write_bytes(head + b"-1.4 is the version header every PDF starts with.\n")
    doc = load_document(path)
    assert doc.kind == "text" and "version header" in doc.text


def test_pdf_magic_then_garbage_is_input_error(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"%PDF-1.7\n" + b"\x00garbage" * 500)
    _error(junk)


def _encrypted(source: Path, target: Path, user: str, owner: str) -> Path:
    writer = PdfWriter(clone_from=str(source))
    writer.encrypt(user_password=user, owner_password=owner, algorithm="RC4-128")
    buffer = io.BytesIO()
    writer.write(buffer)
    target.write_bytes(buffer.getvalue())
    return target


def test_encrypted_pdf_needs_password(good_pdf, tmp_path):
    locked = _encrypted(good_pdf, tmp_path / "locked.pdf", "s3cret", "owner")
    error = _error(locked)
    assert "encrypted" in error.message and "--password" in error.hint
    wrong = _error(locked, password="nope")
    assert "wrong password" in wrong.message
    doc = load_document(locked, password="s3cret")
    assert doc.meta["encrypted"] and doc.text.split().count("Paragraph") == 80


def test_pdf_with_empty_user_password_opens_without_one(good_pdf, tmp_path):
    restricted = _encrypted(good_pdf, tmp_path / "restricted.pdf", "", "owner-only")
    assert "Paragraph 0" in load_document(restricted).text


def _image_page_pdf(path: Path, text_pdf: Path | None = None) -> Path:
    """A PDF whose (last) page draws one 1x1 image and has no text, like a scan."""
    from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject, NumberObject

    writer = PdfWriter(clone_from=str(text_pdf)) if text_pdf else PdfWriter()
    page = writer.add_blank_page(width=612, height=792)
    image = DecodedStreamObject()
    image.set_data(b"\x80")
    image.update({NameObject(k): v for k, v in {
        "/Type": NameObject("/XObject"), "/Subtype": NameObject("/Image"),
        "/Width": NumberObject(1), "/Height": NumberObject(1),
        "/ColorSpace": NameObject("/DeviceGray"), "/BitsPerComponent": NumberObject(8)}.items()})
    page[NameObject("/Resources")] = DictionaryObject({NameObject("/XObject"): DictionaryObject(
        {NameObject("/Im0"): writer._add_object(image)})})
    content = DecodedStreamObject()
    content.set_data(b"q 612 0 0 792 0 0 cm /Im0 Do Q")
    page[NameObject("/Contents")] = writer._add_object(content)
    with path.open("wb") as handle:
        writer.write(handle)
    return path


def test_image_only_pdf_needs_ocr(tmp_path):
    scanned = _image_page_pdf(tmp_path / "scanned.pdf")
    assert len(PdfReader(scanned).pages[0].images) == 1  # oracle: pypdf sees the image
    error = _error(scanned)
    assert "OCR" in error.message and "ocrmypdf" in error.hint


def test_blank_pdf_has_no_text_and_is_not_called_scanned(tmp_path):
    writer = PdfWriter()
    writer.add_blank_page(width=612, height=792)
    writer.add_blank_page(width=612, height=792)
    blank = tmp_path / "blank.pdf"
    with blank.open("wb") as handle:
        writer.write(handle)
    error = _error(blank)
    assert "has no extractable text" in error.message
    assert "scanned" not in error.message and "OCR is needed" not in error.message


def test_partly_scanned_pdf_reports_skipped_pages(good_pdf, tmp_path):
    mixed = _image_page_pdf(tmp_path / "mixed.pdf", text_pdf=good_pdf)
    writer = PdfWriter(clone_from=str(mixed))
    writer.add_blank_page(width=612, height=792)
    with mixed.open("wb") as handle:
        writer.write(handle)
    doc = load_document(mixed)
    assert [s.label for s in doc.sections] == ["page 1", "page 2", "page 3"]
    assert doc.skipped == (("page 4", "no extractable text (image-only page?)"),
                           ("page 5", "no extractable text (no images either)"))


def test_pdf_guards_page_limit_and_clock(good_pdf):
    assert "pages" in _error(good_pdf, limits=IngestLimits(max_pages=2)).message
    assert "longer than" in _error(good_pdf, limits=IngestLimits(pdf_timeout_s=1e-9)).message
    assert "characters" in _error(good_pdf, limits=IngestLimits(max_total_chars=500)).message


def test_pdf_size_limit_refuses_before_pypdf_reads(good_pdf, monkeypatch):
    import pypdf

    opened = []
    monkeypatch.setattr(pypdf.PdfReader, "__init__",
                        lambda self, *a, **kw: opened.append(a) or None)
    size = good_pdf.stat().st_size
    error = _error(good_pdf, limits=IngestLimits(max_pdf_bytes=size - 1))
    assert f"{size:,} bytes, more than the PDF size limit of {size - 1:,} bytes" in error.message
    assert opened == [] and "\n" not in error.message
    monkeypatch.undo()
    assert load_document(good_pdf, limits=IngestLimits(max_pdf_bytes=size)).kind == "pdf"
    assert IngestLimits().max_pdf_bytes == 256 * 1024 * 1024
    with pytest.raises(ConfigError, match="max_pdf_bytes"):
        IngestLimits(max_pdf_bytes=0)


def test_pdf_clock_interrupts_a_parse_that_never_ends(good_pdf, monkeypatch):
    import time

    import pypdf

    def endless(self, stream):  # a cross-reference table pypdf takes 10 s to read
        begun = time.monotonic()
        while time.monotonic() - begun < 10:
            time.sleep(0.01)

    monkeypatch.setattr(pypdf.PdfReader, "read", endless)
    started = time.monotonic()
    error = _error(good_pdf, limits=IngestLimits(pdf_timeout_s=0.3))
    assert "took longer than 0.3 s" in error.message and time.monotonic() - started < 5
    monkeypatch.undo()
    import signal
    for _ in range(20):  # a timer that fires at once, anywhere, still puts the handler back
        _error(good_pdf, limits=IngestLimits(pdf_timeout_s=1e-9))
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_pdf_produces_no_log_noise(tmp_path, caplog, capsys):
    junk = tmp_path / "junk.pdf"
    junk.write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << >>\n")
    with caplog.at_level("DEBUG"):
        _error(junk)
    assert not [r for r in caplog.records if r.name.startswith("pypdf")]
    assert capsys.readouterr().err == ""


# --- text -------------------------------------------------------------------------------------

SAMPLE = "Naïve café — “quoted” €5\nsecond line ✓\n"


@pytest.mark.parametrize("encoding, expected_codec", [
    ("utf-8", "utf-8"), ("utf-8-sig", "utf-8-sig"), ("utf-16", "utf-16"),
    ("utf-16-be-bom", "utf-16"), ("utf-32", "utf-32")])
def test_text_unicode_encodings(tmp_path, encoding, expected_codec):
    path = tmp_path / "note.txt"
    if encoding == "utf-16-be-bom":
        path.write_bytes(b"\xfe\xff" + SAMPLE.encode("utf-16-be"))
    else:
        path.write_bytes(SAMPLE.encode(encoding))
    doc = load_document(path)
    assert doc.text == SAMPLE and doc.kind == "text" and doc.meta["encoding"] == expected_codec


def test_text_legacy_encodings_and_newlines(tmp_path):
    cp = tmp_path / "cp1252.txt"
    cp.write_bytes("Price: 5 € – naïve\r\nnext\rlast".encode("cp1252"))
    doc = load_document(cp)
    assert doc.text == "Price: 5 € – naïve\nnext\nlast" and doc.meta["encoding"] == "cp1252"
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9 \x81 ok")  # 0x81 is undefined in cp1252 -> latin-1
    assert load_document(latin).text == "café \x81 ok"


@pytest.mark.parametrize("payload", [
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(200),
    b"text then a NUL \x00 byte",
    bytes([1, 2, 3, 4, 5, 6, 14, 15, 16, 17]) * 30 + b"some words",
    "UTF-16 without a BOM".encode("utf-16-le"),
])
def test_binary_files_refused(tmp_path, payload):
    path = tmp_path / "blob.txt"
    path.write_bytes(payload)
    assert "binary" in _error(path).message


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.md"
    empty.write_bytes(b"")
    assert "empty" in _error(empty).message
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\n")
    assert "empty" in _error(blank).message
    assert "no such file" in _error(tmp_path / "missing.txt").message


def test_markdown_is_text_with_heading_title(tmp_path):
    md = tmp_path / "notes.md"
    md.write_text("\n# Release plan\n\nShip *it*.\n", encoding="utf-8")
    doc = load_document(md)
    assert doc.kind == "text" and doc.title == "Release plan" and "Ship *it*." in doc.text


def test_limits_validated():
    with pytest.raises(ConfigError, match="max_pages"):
        IngestLimits(max_pages=0)
    with pytest.raises(ConfigError, match="pdf_timeout_s"):
        IngestLimits(pdf_timeout_s=-1.0)


# --- genre ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, kind, genre", [
    ("This Agreement is made between the parties. Clause 4 limits liability; the governing "
     "law is Dutch and breach of confidentiality allows termination.", "pdf", "contract"),
    ("By using the service you agree to these terms of service. We may suspend your account "
     "at our sole discretion; your content is licensed to us.", "text", "contract"),
    ("The patient was admitted with pneumonia. Diagnosis confirmed; treatment with 500 mg "
     "levofloxacin. Discharge medication and follow-up with the physician.", "text", "clinical"),
    ("Abstract. We propose a method; experiments on the dataset beat the baseline, with "
     "significant results (Table 2, Figure 3).", "pdf", "scientific"),
    ("Smith v. Jones. The appellant appeals the judgment entered after a jury verdict. The "
     "respondent argues the trial court was right. We hold that it erred; reversed and "
     "remanded.", "pdf", "judgment"),
    ("BACKGROUND OF THE INVENTION. The present invention relates to a valve. In the prior "
     "art valves leaked. In one embodiment the valve comprises a body wherein the seat is "
     "hollow. What is claimed is: 1. A valve comprising a body.", "text", "patent"),
    ("Mice lacking the receptor gene showed lower expression of the protein in neurons; in "
     "vivo and in vitro assays of the mutant cells confirmed the pathway (p < 0.01).", "text",
     "biomedical"),
    ("GAO was asked to review the program. Federal agencies spent $2 billion in fiscal year "
     "2019; officials told us that the legislation Congress passed lacks oversight. We "
     "recommend that the Department of Energy report on it.", "text", "report"),
    ("import os\n\ndef main():\n    return None\n\nclass Store:\n    def get(self):\n"
     "        return self.x\n", "text", "code"),
    ("We walked to the lake and had a picnic in the sun.", "text", "generic"),
    ("anything at all", "repository", "code"),
    ("def main(): return None — but read as a folder of prose documents", "collection",
     "collection"),
])
def test_guess_genre(text, kind, genre):
    assert guess_genre(text, kind) == genre


def test_an_uncertain_guess_is_generic():
    # as many contract cues as scientific ones: neither wins by the margin
    text = "The agreement and the parties. We propose experiments on a dataset. Liability."
    assert guess_genre(text, "text") == "generic"
    assert canonical_genre("legal") == "contract" and canonical_genre("medical") == "clinical"
    assert canonical_genre("nonsense") == "generic" and canonical_genre(None) == "generic"


# --- repositories -----------------------------------------------------------------------------

def _tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


REPO = {
    "README.md": "# Demo\nA demo project.\n",
    "pyproject.toml": "[project]\nname = 'demo'\n",
    "Makefile": "test:\n\tpytest\n",
    "docs/guide.md": "Guide text.\n",
    "src/app.py": "print('app')\n",
    "src/zeta.py": "print('zeta')\n",
    "src/Alpha.py": "print('alpha')\n",
    "config/settings.yaml": "debug: false\n",
    ".gitignore": "*.log\n!keep.log\nsecret_dir/\n",
    "debug.log": "IGNORED-LOG\n",
    "keep.log": "kept log line\n",
    "secret_dir/x.py": "IGNORED-DIR\n",
    "pkg/.gitignore": "generated.py\n!important.log\n",
    "pkg/generated.py": "IGNORED-NESTED\n",
    "pkg/real.py": "REAL = 1\n",
    "pkg/important.log": "re-included by the nested file\n",
    "other/generated.py": "nested rule does not reach here\n",
    ".git/HEAD": "ref: refs/heads/main\n",
    ".git/info/exclude": "local_notes.txt\n",
    "local_notes.txt": "IGNORED-EXCLUDE\n",
    "image.png": b"\x89PNG\r\n\x1a\n" + bytes(100),
    "blob": b"\x00\x01\x02BINARY-CONTENT" * 10,
    "package-lock.json": '{"LOCKFILE": true}\n',
    "poetry.lock": "LOCKFILE\n",
    "go.sum": "LOCKFILE\n",
    "node_modules/lib/index.js": "VENDORED\n",
    "vendor/dep.go": "VENDORED\n",
    "build/out.py": "VENDORED\n",
    "src/__pycache__/app.cpython-311.pyc": b"\x00\x01VENDORED",
    "myenv/pyvenv.cfg": "home = /usr/bin\n",
    "myenv/lib/site.py": "VENDORED-VENV\n",
    "big.txt": "BIG " * 1500,
    "static/app.min.js": "var a=1;MINIFIED\n",
    "static/bundle.js": "var x=1;" * 300 + "MINIFIED\n",
    "empty.py": "",
}
# Hand-written: README, then config, docs, sources, other; case-insensitive A-Z in each group.
EXPECTED_ORDER = ["README.md",
                  "Makefile", "pyproject.toml",
                  "docs/guide.md",
                  "link_in.py", "other/generated.py", "pkg/real.py", "src/Alpha.py", "src/app.py",
                  "src/zeta.py",
                  ".gitignore", "config/settings.yaml", "keep.log", "pkg/.gitignore",
                  "pkg/important.log"]


@pytest.fixture
def repo(tmp_path) -> Path:
    root = _tree(tmp_path / "demo", REPO)
    outside = _tree(tmp_path / "outside", {"secret.txt": "TOP-SECRET-OUTSIDE\n"})
    (root / "link_out.txt").symlink_to(outside / "secret.txt")
    (root / "link_dir").symlink_to(outside, target_is_directory=True)
    (root / "link_in.py").symlink_to(root / "src" / "app.py")
    (root / "dangling.txt").symlink_to(tmp_path / "nowhere")
    return root


def test_repository_reads_the_right_files_in_order(repo):
    doc = load_document(repo, limits=IngestLimits(max_file_bytes=5000))
    assert [s.label for s in doc.sections] == EXPECTED_ORDER
    assert doc.text.count("print('app')") == 2  # link_in.py -> src/app.py, inside the root
    assert doc.kind == "repository" and doc.genre == "code" and doc.title == "demo"
    for section in doc.sections:
        assert doc.text[section.start:section.end].startswith(f"===== {section.label} =====\n")
    for marker in ("IGNORED", "LOCKFILE", "VENDORED", "BINARY-CONTENT", "TOP-SECRET",
                   "MINIFIED", "BIG BIG"):
        assert marker not in doc.text, marker


def test_repository_reports_every_skip_with_reason(repo):
    skipped = dict(load_document(repo, limits=IngestLimits(max_file_bytes=5000)).skipped)
    expect = {
        ".git/": "version-control metadata", "debug.log": "ignored by .gitignore",
        "secret_dir/": "ignored by .gitignore", "pkg/generated.py": "ignored by .gitignore",
        "local_notes.txt": "ignored by .gitignore", "image.png": "binary file",
        "blob": "binary file", "package-lock.json": "lock file", "poetry.lock": "lock file",
        "go.sum": "lock file", "node_modules/": "vendored/build/cache folder",
        "vendor/": "vendored/build/cache folder", "build/": "vendored/build/cache folder",
        "src/__pycache__/": "vendored/build/cache folder", "myenv/": "virtualenv folder",
        "static/app.min.js": "minified or source-map file",
        "static/bundle.js": "minified or machine-generated (very long lines)",
        "empty.py": "empty file", "link_dir": "symlink points outside the repository "
        "(not followed)", "link_out.txt": "symlink points outside the repository (not followed)",
        "dangling.txt": "broken or looping symlink",
    }
    for item, reason in expect.items():
        assert skipped.get(item) == reason, item
    assert skipped["big.txt"].startswith("larger than the per-file limit of 5,000 bytes")


def test_symlinked_directory_inside_root_not_followed(tmp_path):
    root = _tree(tmp_path / "r", {"README.md": "hi\n", "src/a.py": "A = 1\n"})
    (root / "alias").symlink_to(root / "src", target_is_directory=True)
    doc = load_document(root)
    assert [s.label for s in doc.sections] == ["README.md", "src/a.py"]
    assert dict(doc.skipped)["alias"] == "symlinked directory (not followed)"


def test_repository_order_is_deterministic(tmp_path):
    files = {"b.py": "b\n", "A.py": "a\n", "README.rst": "read me\n", "docs/x.md": "x\n",
             "setup.py": "setup()\n", "lib/c.py": "c\n"}
    first = _tree(tmp_path / "one", files)
    second = _tree(tmp_path / "two", dict(reversed(list(files.items()))))
    a, b = load_document(first), load_document(second)
    assert a.text == b.text
    assert [s.label for s in a.sections] == ["README.rst", "setup.py", "docs/x.md", "A.py",
                                             "b.py", "lib/c.py"]


def test_repository_total_cap_keeps_priority_files(tmp_path):
    files = {"README.md": "r" * 100 + "\n"}
    files.update({f"src/m{i}.py": f"x{i} = {i}\n" * 20 for i in range(5)})
    doc = load_document(_tree(tmp_path / "r", files), limits=IngestLimits(max_total_chars=400))
    assert doc.sections[0].label == "README.md" and len(doc.text) <= 400
    reasons = dict(doc.skipped)
    assert reasons["src/m4.py"] == "total size cap of 400 characters reached"
    assert len(doc.sections) + sum(r.startswith("total size cap") for r in reasons.values()) == 6


def test_repository_file_count_cap(tmp_path):
    root = _tree(tmp_path / "r", {f"f{i}.py": f"v = {i}\n" for i in range(5)})
    doc = load_document(root, limits=IngestLimits(max_files=2))
    assert [s.label for s in doc.sections] == ["f0.py", "f1.py"]
    assert dict(doc.skipped)["f4.py"] == "file-count cap of 2 files reached"


def test_empty_or_unreadable_repository_is_input_error(tmp_path):
    (tmp_path / "nothing").mkdir()
    assert "no readable text files" in _error(tmp_path / "nothing").message
    only_binary = _tree(tmp_path / "bin", {"a.png": b"\x89PNG" + bytes(20), "x.lock": "l\n"})
    error = _error(only_binary)
    assert "binary file" in error.hint and "lock file" in error.hint


# --- repositories: links to excluded files, VCS metadata, enclosing repository, odd names ---

def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


@needs_git
def test_symlink_to_a_file_the_walk_excludes_is_not_read(tmp_path):
    root = _tree(tmp_path / "r", {
        "README.md": "readme\n", "ok.py": "OK = 1\n",
        ".gitignore": ".env\nsecretdir/\n", ".env": "TOKEN=LEAK-ENV\n",
        "secretdir/s.txt": "LEAK-IGNORED-DIR\n", "x.secret": "LEAK-EXCLUDE\n",
        "pkg/.gitignore": "gen.txt\n", "pkg/gen.txt": "LEAK-NESTED\n",
        "node_modules/x/i.js": "LEAK-VENDORED\n", ".hg/hgrc": "[auth]\nLEAK-HG\n",
        "package-lock.json": '{"LEAK-LOCK": 1}\n', "big.txt": "LEAK-BIG " * 1000})
    _git(root, "init", "-q")
    (root / ".git" / "config").write_text("[remote]\n url = https://LEAK-GIT@example\n")
    (root / ".git" / "info" / "exclude").write_text("*.secret\n")
    targets = {"l_git.txt": ".git/config", "l_env.txt": ".env", "l_dir.txt": "secretdir/s.txt",
               "l_excl.txt": "x.secret", "l_nested.txt": "pkg/gen.txt",
               "l_vendor.js": "node_modules/x/i.js", "l_hg.txt": ".hg/hgrc",
               "l_lock.txt": "package-lock.json", "l_big.txt": "big.txt", "l_ok.txt": "ok.py"}
    for link, target in targets.items():
        (root / link).symlink_to(target)
    ignored = _git(root, "check-ignore", "--no-index", ".env", "secretdir/s.txt", "x.secret",
                   "pkg/gen.txt").split()  # oracle: git agrees those targets are ignored
    assert ignored == [".env", "secretdir/s.txt", "x.secret", "pkg/gen.txt"]
    doc = load_document(root, limits=IngestLimits(max_file_bytes=5000))
    assert "LEAK" not in doc.text
    assert doc.text.count("OK = 1") == 2  # a link to a file that is read is still read
    skipped = dict(doc.skipped)
    for link, target in targets.items():
        if link != "l_ok.txt":
            assert skipped[link].startswith(f"symlink to {target}, which is not read: "), link
    assert skipped["l_excl.txt"].endswith("ignored by .gitignore")
    assert skipped["l_git.txt"].endswith("version-control metadata")


@pytest.mark.parametrize("metadata", [".git/config", ".hg/hgrc", ".svn/entries", ".bzr/branch",
                                      "CVS/Root", "_darcs/prefs", ".jj/repo", ".fslckout",
                                      "_FOSSIL_", "project.fossil"])
def test_version_control_metadata_is_never_read(tmp_path, metadata):
    root = _tree(tmp_path / "r", {"main.py": "MAIN = 1\n", metadata: "password=LEAK\n"})
    doc = load_document(root)
    assert "LEAK" not in doc.text and [s.label for s in doc.sections] == ["main.py"]
    top = metadata.split("/")[0]
    item = top + "/" if "/" in metadata else top
    assert dict(doc.skipped)[item] == "version-control metadata"


@needs_git
def test_subfolder_of_a_repository_applies_the_enclosing_ignore_rules(tmp_path):
    parent = _tree(tmp_path / "parent", {
        ".gitignore": "*.env\nlocal/\nsrc/build.txt\n", "src/.gitignore": "!keep.env\n",
        "src/a.py": "A = 1\n", "src/secrets.env": "LEAK-ENV\n", "src/keep.env": "KEPT\n",
        "src/build.txt": "LEAK-ANCHORED\n", "src/sub/b.py": "B = 2\n",
        "src/sub/x.tmp": "LEAK-EXCLUDE\n", "local/notes.md": "LEAK-LOCAL\n"})
    _git(parent, "init", "-q")
    (parent / ".git" / "info" / "exclude").write_text("*.tmp\n")
    src = parent / "src"
    tracked = set(_git(src, "ls-files", "--others", "--exclude-standard").split())
    assert tracked == {".gitignore", "a.py", "keep.env", "sub/b.py"}  # oracle: git
    doc = load_document(src)
    assert {s.label for s in doc.sections} == tracked and "LEAK" not in doc.text
    skipped = dict(doc.skipped)
    assert skipped["secrets.env"] == skipped["sub/x.tmp"] == "ignored by .gitignore"
    error = _error(parent / "local")  # git ignores the whole folder: nothing is read
    assert "ignored by the .gitignore" in error.message
    # a worktree's .git is a `gitdir:` file; the main repository's info/exclude still applies
    _git(parent, "add", "-A")
    _git(parent, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    _git(parent, "worktree", "add", "-q", str(tmp_path / "wt"))
    (tmp_path / "wt" / "src" / "sub" / "y.tmp").write_text("LEAK-WT\n")
    assert "LEAK" not in load_document(tmp_path / "wt" / "src").text
    # above a folder that is not in a git work tree, .gitignore files are not applied
    plain = _tree(tmp_path / "plain", {".gitignore": "*.env\n", "in/k.env": "K=1\n"})
    assert [s.label for s in load_document(plain / "in").sections] == ["k.env"]



def test_repository_file_names_cannot_fake_a_header_line(tmp_path):
    """A newline (or another control character) in a file name is escaped in its header, so a
    name cannot add a `===== path =====` line of its own; names that are not UTF-8 show their
    bytes as \\xNN."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "main.py").write_text("print('hello')\n")
    (repo / "x.py\n===== secrets.env =====").write_text("value = 1\n")
    (repo / "tab\there.py").write_text("value = 2\n")
    (repo / b"caf\xe9.py".decode("utf-8", "surrogateescape")).write_text("value = 3\n")
    doc = load_document(repo)
    headers = [line for line in doc.text.splitlines() if line.startswith("=====")]
    assert len(headers) == 4, headers  # one per file, none injected
    assert "===== x.py\\n===== secrets.env ===== =====" in headers
    assert "===== tab\\there.py =====" in headers and "===== caf\\xe9.py =====" in headers
    assert {s.label for s in doc.sections} >= {"main.py", "caf\\xe9.py"}
