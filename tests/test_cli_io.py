"""CLI input/output edges: --out paths checked before the run (and the result kept when the
write fails anyway), file modes, unreadable inputs, corrupt weights, usage errors and help
text. Same tiny model and CliRunner conventions as test_cli.py."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

from helpers_cli import assert_error, run, show
from helpers_tokenizer import make_tiny_model_dir
from hisparse_cli.cli.app import app

TINY_FLAGS = ["--profile", "cpu", "-n", "4", "--window", "64", "--prefill-chunk", "64",
              "--global-tokens", "8", "--recalibrate-every", "64", "--recalibrate-topk", "8"]
TEXT = "The client pays a monthly fee of EUR 7,400 within thirty days of the invoice.\n"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HISPARSE_DEBUG", raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("cli_io"), max_position_embeddings=1024)


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "deal.txt"
    path.write_text(TEXT * 2, encoding="utf-8")
    return path


# --- summarize --out ---------------------------------------------------------------------------
# A model path that does not exist: an --out error must come first (exit 2/3, not 4).
def test_out_is_checked_before_the_model_loads(doc, tmp_path):
    nowhere = tmp_path / "no-model"
    assert_error(run("summarize", doc, "--model", nowhere, "--out", tmp_path), 2, "is a folder")
    assert_error(run("summarize", doc, "--model", nowhere, "--out", tmp_path / "no" / "s.txt"),
                 3, "does not exist")


def test_out_in_a_folder_that_cannot_be_written(doc, tmp_path, monkeypatch):
    import hisparse_cli.cli.outputs as outputs

    def refuse(**kw):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(outputs.tempfile, "mkstemp", refuse)  # root ignores chmod 555
    assert_error(run("summarize", doc, "--model", tmp_path / "no-model", "--out",
                     tmp_path / "s.txt"), 3, "Permission denied")


def test_out_on_a_virtual_file_system(doc, tmp_path):
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    assert_error(run("summarize", doc, "--model", tmp_path / "no-model", "--out",
                     "/proc/s.txt"), 3, "/proc/s.txt")


def test_a_failed_write_at_the_end_keeps_the_summary(tiny, doc, tmp_path, monkeypatch):
    import hisparse_cli.cli.summarize as cli_summarize

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli_summarize, "write_atomic", full)
    result = run("summarize", doc, "--model", tiny, "--out", tmp_path / "s.txt", "-q",
                 *TINY_FLAGS)
    assert result.exit_code == 3, show(result)
    assert result.stdout.endswith("\n") and len(result.stdout) > 1, show(result)  # the summary
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("Error: ") and "No space left" in lines[0], show(result)
    assert "printed on stdout" in lines[0] and lines[1].startswith("Hint: "), show(result)


def test_out_file_modes_follow_the_umask_and_are_kept(tiny, doc, tmp_path):
    from hisparse_cli.cli.outputs import write_atomic

    old = os.umask(0o027)
    try:
        new = tmp_path / "new.txt"
        write_atomic(new, "x\n")
        assert stat.S_IMODE(new.stat().st_mode) == 0o640
        kept = tmp_path / "kept.txt"
        kept.write_text("old\n")
        kept.chmod(0o604)
        result = run("summarize", doc, "--model", tiny, "--out", kept, "-q", *TINY_FLAGS)
        assert result.exit_code == 0, show(result)
        assert stat.S_IMODE(kept.stat().st_mode) == 0o604 and kept.read_text() != "old\n"
    finally:
        os.umask(old)


def test_out_through_a_symlink_writes_the_target(tmp_path):
    from hisparse_cli.cli.outputs import check_output_file, write_atomic

    target = tmp_path / "real.txt"
    target.write_text("old\n")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    write_atomic(check_output_file(link), "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"


def test_eval_out_must_be_a_folder(doc, tmp_path):
    afile = tmp_path / "report.txt"
    afile.write_text("mine\n")
    assert_error(run("eval", doc, "--model", tmp_path / "no-model", "--out", afile), 2,
                 "is a file, not a folder")
    assert afile.read_text() == "mine\n"


# --- eval reads documents like summarize --------------------------------------------------------
def _locked_pdf(tmp_path) -> Path:
    import importlib.util

    from pypdf import PdfReader, PdfWriter

    spec = importlib.util.spec_from_file_location(
        "make_contract_pdf", Path(__file__).resolve().parent.parent / "samples"
        / "make_contract_pdf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plain = tmp_path / "plain.pdf"
    plain.write_bytes(module.build_pdf(TEXT * 4, title="Locked"))
    writer = PdfWriter()
    for page in PdfReader(str(plain)).pages:
        writer.add_page(page)
    writer.encrypt(user_password="s3cret", owner_password="owner", algorithm="RC4-128")
    locked = tmp_path / "locked.pdf"
    with open(locked, "wb") as handle:
        writer.write(handle)
    return locked


def test_eval_takes_the_password_its_hint_names(tmp_path):
    locked = _locked_pdf(tmp_path)
    nowhere = tmp_path / "no-model"  # documents are read before the model: 4 means read
    out = tmp_path / "report"
    assert_error(run("eval", locked, "--model", nowhere, "--out", out), 3, "--password")
    assert_error(run("eval", locked, "--model", nowhere, "--out", out, "--password", "nope"),
                 3, "wrong password")
    assert_error(run("eval", locked, "--model", nowhere, "--out", out, "--password", "s3cret"),
                 4)


# --- corrupt weights are a model problem (exit 4) ------------------------------------------------
def _copy_model(tiny: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(tiny, dest)
    return dest


@pytest.mark.parametrize("damage, needle", [
    (lambda data: data[: len(data) // 2], "incomplete metadata"),  # a cut-off download
    (lambda data: os.urandom(4096), "cannot read weights"),  # not safetensors at all
])
def test_corrupt_model_weights_exit_4(tiny, doc, tmp_path, damage, needle):
    model = _copy_model(tiny, tmp_path / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    assert_error(run("summarize", doc, "--model", model, *TINY_FLAGS), 4, needle,
                 "download it again")


def _probe(folder: Path, hidden: int, layers: int, kv_heads: int) -> Path:
    from hisparse_cli.quality.probe import ImportanceProbe, rank_for, save_probe

    module = ImportanceProbe(hidden, layers, kv_heads, rank_for(hidden, layers, kv_heads))
    weights, _ = save_probe(module, folder / f"h{hidden}.safetensors", {})
    return weights


def test_corrupt_or_foreign_probe_is_not_an_internal_error(tiny, doc, tmp_path):
    from hisparse_cli.model.config import ModelConfig

    cfg = ModelConfig.from_folder(tiny)
    probe = _probe(tmp_path, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads)
    flags = ["--model", tiny, "--importance", "probe", *TINY_FLAGS]
    ok = run("summarize", doc, "--probe", probe, "-q", *flags)
    assert ok.exit_code == 0, show(ok)  # the probe as saved works
    probe.write_bytes(probe.read_bytes()[:40])  # cut short
    assert_error(run("summarize", doc, "--probe", probe, *flags), 4, "probe train")
    other = _probe(tmp_path, 2 * cfg.hidden_size, cfg.num_hidden_layers + 1, 1)
    assert_error(run("summarize", doc, "--probe", other, *flags), 2, "another model")


def test_a_gguf_that_is_not_one_exits_4_with_a_download_hint(doc, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(os.urandom(2048))
    assert_error(run("summarize", doc, "--model", bad, "-q", *TINY_FLAGS), 4,
                 "fetch the file again")


# --- help text and tables -----------------------------------------------------------------------
def _commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, path + (name,))


def test_every_default_note_in_a_help_text_is_shown():
    import re

    import typer

    notes_seen = 0
    for path, command in _commands(typer.main.get_command(app)):
        notes = [note for param in command.params
                 for note in re.findall(r"\[default: [^\]]*\]", getattr(param, "help", "") or "")]
        if not notes:
            continue
        result = run(*path, "--help", env={"COLUMNS": "400"})
        assert result.exit_code == 0, show(result)
        text = " ".join(result.stdout.split())
        for note in notes:
            assert note.replace("\\[", "[") in text, (path, note)
            notes_seen += 1
    assert notes_seen >= 10  # summarize, batch, eval, plan, quantize, probe train


def test_generation_ranges_in_help_match_validation(doc):
    text = " ".join(run("summarize", "--help", env={"COLUMNS": "400"}).stdout.split())
    assert "[0<x<=1]" in text and "[x>0]" in text and "[x>=0]" in text
    for flags in (["--top-p", "0"], ["--top-p", "1.5"], ["--repetition-penalty", "0"],
                  ["--temperature", "inf"], ["--temperature", "nan"], ["--top-p", "nan"]):
        assert_error(run("summarize", doc, *flags), 2, flags[0])
    for value in ("inf", "nan", "0"):  # plan's budget: finite and >= 0.01 GiB
        assert_error(run("plan", "--budget-gib", value), 2, "--budget-gib")


def test_models_list_piped_keeps_whole_names():
    result = run("models", "list")
    assert result.exit_code == 0, show(result)
    assert "smollm2-135m-instruct (default)" in result.stdout and "…" not in result.stdout


def test_generation_config_rejects_non_finite_values_with_a_hint():
    from hisparse_cli.config.settings import GenerationConfig
    from hisparse_cli.errors import ConfigError

    for bad in ({"temperature": float("inf")}, {"temperature": float("nan")},
                {"top_p": 0.0}, {"repetition_penalty": float("inf")},
                {"repetition_penalty": 0.0}):
        with pytest.raises(ConfigError) as info:
            GenerationConfig(**bad)
        assert info.value.hint, bad


def test_every_error_has_a_hint_line(tiny, doc, tmp_path):
    model = _copy_model(tiny, tmp_path / "model")
    (model / "config.json").write_text("{not json")
    assert_error(run("summarize", doc, "--model", model, *TINY_FLAGS), 4, "not valid JSON",
                 "config.json")
    from hisparse_cli.errors import ConfigError, InputError, ModelError, ResourceError

    for cls in (ConfigError, InputError, ModelError, ResourceError):
        assert cls("something").hint  # the class's default when the raiser gave none


# --- unreadable inputs are input problems (exit 3) -----------------------------------------------
# As root, chmod 000 does not stop reading: the denial is simulated where the code asks for it
# (os.access, stat, read_bytes); the real chmod runs where the tests are not root.
@pytest.fixture
def unreadable(monkeypatch):
    """Paths made unreadable: os.access says no, reading raises EACCES; a path inside a
    `denied` folder cannot even be stat'ed (a parent without search permission)."""
    denied: set[str] = set()
    real_access, real_stat, real_read = os.access, Path.stat, Path.read_bytes

    def blocked(path) -> bool:
        path = os.path.abspath(os.fspath(path))
        return any(path == d or path.startswith(d + os.sep) for d in denied)

    def inside(path) -> bool:
        path = os.path.abspath(os.fspath(path))
        return any(path.startswith(d + os.sep) for d in denied)

    def access(path, mode, *a, **kw):
        return False if blocked(path) else real_access(path, mode, *a, **kw)

    def stat_(self, *a, **kw):
        if inside(self):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *a, **kw)

    def read_bytes(self):
        if blocked(self):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read(self)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(Path, "stat", stat_)
    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    return lambda path: denied.add(os.path.abspath(path)) or path


def test_unreadable_document_exits_3(doc, tmp_path, unreadable):
    nowhere = tmp_path / "no-model"
    assert_error(run("summarize", unreadable(doc), "--model", nowhere), 3, "permission denied",
                 "chmod")
    folder = tmp_path / "nox"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT)
    unreadable(folder)
    assert_error(run("summarize", folder / "a.txt", "--model", nowhere), 3, "Permission denied")
    assert_error(run("summarize", folder, "--model", nowhere), 3, "permission denied")


def test_unreadable_reference_and_score_inputs_exit_3(doc, tmp_path, unreadable):
    ref = tmp_path / "ref.txt"
    ref.write_text("The client pays a monthly fee.\n")
    unreadable(ref)
    assert_error(run("summarize", doc, "--model", tmp_path / "no-model", "--reference", ref), 3,
                 "cannot read reference", "Permission denied")
    assert_error(run("score", ref, doc), 3, "cannot read summary")
    assert_error(run("score", doc, ref), 3, "cannot read reference")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_document_exits_3_for_real(doc, tmp_path):
    doc.chmod(0)
    try:
        assert_error(run("summarize", doc, "--model", tmp_path / "no-model"), 3,
                     "permission denied")
    finally:
        doc.chmod(0o644)


# --- smaller messages ----------------------------------------------------------------------------
def test_models_subcommands_hint_what_they_accept():
    for sub in ("path", "rm"):
        result = run("models", sub, "nope")
        assert_error(result, 4, "unknown model 'nope'", "models list")
        assert "hub id" not in result.stderr and ".gguf file" not in result.stderr
    assert_error(run("models", "pull", "nope"), 4, "needs no pull")


def test_profile_paths_and_names(doc, tmp_path):
    assert_error(run("profiles", "show", tmp_path / "missing.toml"), 2, "does not exist")
    assert_error(run("profiles", "show", tmp_path), 2, "is a folder")
    assert_error(run("profiles", "show", "nope"), 2, "unknown profile 'nope'")
    shown = run("profiles", "show", "CPU", "--json")
    assert shown.exit_code == 0 and json.loads(shown.stdout)["name"] == "cpu", show(shown)
    table = run("profiles", "show", "cpu")
    assert "loaded as float32" in table.stdout, show(table)  # what the cpu run really uses


def test_score_says_a_folder_is_a_folder(doc, tmp_path):
    assert_error(run("score", tmp_path, doc), 3, "is a folder")


def test_probe_file_implies_importance_probe(doc):
    from hisparse_cli.cli.options import RunOptions
    from hisparse_cli.errors import ConfigError
    from hisparse_cli.config.profiles import load_profile

    cpu = load_profile("cpu")
    assert RunOptions(probe=Path("p.safetensors")).sparse(cpu).importance == "probe"
    assert RunOptions().sparse(cpu).importance == cpu.sparse.importance
    with pytest.raises(ConfigError, match="--importance probe"):
        RunOptions(probe=Path("p.safetensors"),
                   sparse_flags={"importance": "snapkv"}).sparse(cpu)
    assert_error(run("summarize", doc, "--probe", "p.safetensors", "--dense", "-p", "cpu"), 2,
                 "dense attention cannot be combined with --probe")
