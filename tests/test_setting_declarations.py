"""One declaration per sparse setting (issue 39, item 3): a SparseConfig field alone gives the
profile's [sparse] key, the CLI flag of summarize and batch (with its rule), and the
`hisparse eval --settings` key; nothing else lists the names."""

from dataclasses import fields

import pytest
from typer.testing import CliRunner

from hisparse_cli.cli.app import app
from hisparse_cli.config.profiles import profile_from_toml
from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.errors import ConfigError
from hisparse_cli.quality.settings import parse_setting

FIELDS = list(fields(SparseConfig))


def _value(f):
    return f.metadata["choices"][-1] if f.metadata["choices"] else f.default + 3


class _Stop(Exception):
    pass


@pytest.mark.parametrize("command", ["summarize", "batch"])
def test_every_field_is_a_flag_that_reaches_the_config(command, monkeypatch, tmp_path):
    import hisparse_cli.cli.options as options

    seen, real = {}, options.RunOptions.sparse

    def spy(self, profile):  # the command's own resolution, then stop before any model loads
        seen["sparse"] = real(self, profile)
        raise _Stop

    monkeypatch.setattr(options.RunOptions, "sparse", spy)
    doc = tmp_path / "d.txt"
    doc.write_text("A short text.\n")
    args = [command, str(doc), "--profile", "cpu"]
    for f in FIELDS:
        args += [f.metadata["flag"], str(_value(f))]
    if command == "batch":
        args += ["--out", str(tmp_path / "r.jsonl")]
    result = CliRunner().invoke(app, args)
    assert "sparse" in seen, result.output
    for f in FIELDS:
        assert getattr(seen["sparse"], f.name) == _value(f), f.name


def test_flag_rule_comes_from_the_declaration(tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("text\n")
    for f in FIELDS:
        if f.metadata["minimum"] is None:
            continue
        bad = CliRunner().invoke(app, ["summarize", str(doc), f.metadata["flag"],
                                       str(f.metadata["minimum"] - 1)])
        assert bad.exit_code == 2 and f.metadata["flag"] in bad.output, f.name


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_profile_table_and_eval_key_take_every_field(tmp_path, f):
    value = _value(f)
    shown = f'"{value}"' if isinstance(value, str) else value
    path = tmp_path / "mine.toml"
    path.write_text(f'name = "mine"\n[sparse]\n{f.name} = {shown}\n')
    assert getattr(profile_from_toml(path).sparse, f.name) == value
    assert getattr(parse_setting(f"{f.name}={value}").sparse, f.name) == value
    for alias in f.metadata["aliases"]:
        assert getattr(parse_setting(f"{alias}={value}").sparse, f.name) == value
    if f.metadata["short"]:
        assert getattr(parse_setting(f"{f.metadata['short']}{value}").sparse, f.name) == value


def test_a_new_field_needs_no_other_list():
    """The names are declared once: flags, eval letters and aliases do not collide."""
    flags = [f.metadata["flag"] for f in FIELDS]
    shorts = [f.metadata["short"] for f in FIELDS if f.metadata["short"]]
    aliases = [a for f in FIELDS for a in f.metadata["aliases"]]
    assert len(set(flags)) == len(flags) and len(set(shorts)) == len(shorts)
    assert len(set(aliases)) == len(aliases) and not set(aliases) & {f.name for f in FIELDS}
    with pytest.raises(ConfigError, match="unknown sparse setting"):
        SparseConfig().with_overrides(windw=1)
