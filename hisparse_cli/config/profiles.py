"""Hardware profiles: `hisparse_cli/profiles/<name>.toml` → validated `HardwareProfile`.

A profile bundles the sparse-KV policy and the memory choices that suit one class of device
(`hisparse summarize --profile 4060ti-6g …`). Precedence of every setting, stated once:

    CLI flag  >  profile (this file's TOML)  >  built-in default (SparseConfig / dataclass)

A TOML may omit any field except `name`; omitted fields take the built-in default. Unknown
keys and bad values are refused with a ConfigError naming the file and the field.
`auto_profile_name(total_bytes)` is the pure choice behind `--profile auto`.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path

from hisparse_cli.config.settings import GenerationConfig, SparseConfig
from hisparse_cli.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

KV_DTYPES = ("float16", "bfloat16", "float32")
ATTENTION_MODES = ("auto", "dense", "sparse")  # planner/attention_choice.py re-exports it
WEIGHT_FORMATS = ("fp16", "awq-int4")
LM_HEAD_FORMATS = ("checkpoint", "int8")
GIB = 1 << 30


def _int_field(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}",
                          hint=f"set {name} to a whole number of at least {minimum}")


def _choice_field(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}",
                          hint=f"set {name} to one of: {', '.join(choices)}")


@dataclass(frozen=True)
class HardwareProfile:
    """Settings for one device class. Sizes in tokens unless stated.

    vram_budget_gib:     GPU memory the run may use (GiB); None = CPU, no device budget
    sparse:              the sparse KV policy (the TOML's `[sparse]` table; omitted fields
                         take SparseConfig's defaults, which also validates them)
    kv_dtype:            dtype of the paged K/V cache
    weight_format:       "fp16" weights or "awq-int4" quantized linear layers
    embeddings_on_host:  keep the token-embedding table in host RAM (saves VRAM)
    lm_head_format:      "checkpoint" (the output head as the checkpoint has it) or "int8"
                         (an fp head quantized at load, per-row symmetric: half the bytes,
                         model/int8_linear.py; a head already INT4 stays INT4)
    max_new_tokens:      default cap of the summary's tokens
    attention:           auto | dense | sparse (planner/attention_choice.py; auto: dense when
                         it fits)
    """

    name: str
    description: str = ""
    vram_budget_gib: float | None = None
    sparse: SparseConfig = SparseConfig()
    kv_dtype: str = "float16"
    weight_format: str = "fp16"
    embeddings_on_host: bool = False
    lm_head_format: str = "checkpoint"
    max_new_tokens: int = GenerationConfig().max_new_tokens
    attention: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.description, str):
            raise ConfigError(f"description must be a string, got {self.description!r}")
        budget = self.vram_budget_gib
        if budget is not None and (isinstance(budget, bool) or not isinstance(
                budget, (int, float)) or not budget > 0):
            raise ConfigError(f"vram_budget_gib must be a number > 0, got {budget!r}",
                              hint="give the GPU memory budget in GiB, or omit it for cpu")
        if not isinstance(self.sparse, SparseConfig):
            raise ConfigError(f"sparse must be a SparseConfig, got {type(self.sparse).__name__}")
        if self.sparse.window_size is None:
            raise ConfigError("sparse.window_size must be set in a profile",
                              hint="dense attention is a run's choice (--dense), not a profile's")
        _int_field("max_new_tokens", self.max_new_tokens, 1)
        _choice_field("kv_dtype", self.kv_dtype, KV_DTYPES)
        _choice_field("weight_format", self.weight_format, WEIGHT_FORMATS)
        _choice_field("lm_head_format", self.lm_head_format, LM_HEAD_FORMATS)
        _choice_field("attention", self.attention, ATTENTION_MODES)
        if not isinstance(self.embeddings_on_host, bool):
            raise ConfigError(f"embeddings_on_host must be true or false, "
                              f"got {self.embeddings_on_host!r}")

    @property
    def vram_budget_bytes(self) -> int | None:
        return None if self.vram_budget_gib is None else int(self.vram_budget_gib * GIB)

    def sparse_config(self, **overrides: object) -> SparseConfig:
        """The profile's SparseConfig with CLI overrides applied.

        Precedence: a non-None override (CLI flag) > this profile's value > SparseConfig's
        built-in default (already folded into the profile's own defaults). None = "flag not
        given". Unknown override names raise ConfigError.
        """
        return self.sparse.with_overrides(**overrides)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


_FIELD_NAMES = tuple(f.name for f in fields(HardwareProfile))
_SPARSE_NAMES = tuple(f.name for f in fields(SparseConfig))


def _sparse_table(path: Path, data: dict) -> None:
    """Replace `data["sparse"]` (the TOML's `[sparse]` table) by its SparseConfig, in place."""
    misplaced = sorted(set(data) & set(_SPARSE_NAMES))
    if misplaced:
        raise ConfigError(f"profile {path}: {', '.join(misplaced)} belong(s) in the [sparse] "
                          "table", hint="move them under a [sparse] line (see `hisparse "
                                        "profiles show cpu` or the shipped profiles)")
    table = data.get("sparse", {})
    if not isinstance(table, dict):
        raise ConfigError(f"profile {path}: sparse must be a table ([sparse]), got {table!r}")
    unknown = sorted(set(table) - set(_SPARSE_NAMES))
    if unknown:
        raise ConfigError(f"profile {path}: unknown field(s) in [sparse]: {', '.join(unknown)}",
                          hint=f"known fields: {', '.join(_SPARSE_NAMES)}")
    try:
        data["sparse"] = SparseConfig(**table)
    except ConfigError as exc:
        raise ConfigError(f"profile {path}: [sparse] {exc.message}", hint=exc.hint) from None


def profile_from_toml(path: Path | str, text: str | None = None) -> HardwareProfile:
    """Parse and validate one profile file. `text` overrides reading `path` (for packages)."""
    path = Path(path)
    try:
        raw = text if text is not None else path.read_text(encoding="utf-8")
        data = tomllib.loads(raw)
    except OSError as exc:
        raise ConfigError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"profile {path} is not valid TOML: {exc}",
                          hint="fix the syntax (see the shipped profiles for examples)") from None
    _sparse_table(path, data)
    unknown = sorted(set(data) - set(_FIELD_NAMES))
    if unknown:
        raise ConfigError(f"profile {path}: unknown field(s) {', '.join(unknown)}",
                          hint=f"known fields: {', '.join(_FIELD_NAMES)}")
    if "name" not in data:
        raise ConfigError(f"profile {path}: missing field name",
                          hint=f"add name = \"{path.stem}\"")
    if isinstance(data.get("vram_budget_gib"), int) and not isinstance(
            data["vram_budget_gib"], bool):
        data["vram_budget_gib"] = float(data["vram_budget_gib"])
    try:
        profile = HardwareProfile(**data)
    except ConfigError as exc:
        raise ConfigError(f"profile {path}: {exc.message}", hint=exc.hint) from None
    if path.suffix == ".toml" and profile.name != path.stem:
        raise ConfigError(f"profile {path}: field name is {profile.name!r} but the file is "
                          f"named {path.name}", hint=f"set name = \"{path.stem}\"")
    return profile


def _shipped() -> dict[str, resources.abc.Traversable]:
    folder = resources.files("hisparse_cli.profiles")
    return {entry.name[:-5]: entry for entry in folder.iterdir()
            if entry.name.endswith(".toml") and entry.is_file()}


def list_profiles() -> list[HardwareProfile]:
    """Every shipped profile: cpu first, then by VRAM budget, then by name."""
    profiles = [profile_from_toml(Path(name + ".toml"), entry.read_text(encoding="utf-8"))
                for name, entry in _shipped().items()]
    return sorted(profiles, key=lambda p: (p.vram_budget_gib or 0.0, p.name))


def load_profile(name: str) -> HardwareProfile:
    """A shipped profile by name (any case, like model names), a path to a .toml file, or
    "auto" (detects the GPU). A value that looks like a path (ends in .toml, holds a / or
    starts with ~) and names no file is reported as such, not as an unknown profile."""
    key = name.strip().lower()
    if key == "auto":
        key = detect_auto_profile()
    shipped = _shipped()
    if key in shipped:
        return profile_from_toml(Path(key + ".toml"), shipped[key].read_text(encoding="utf-8"))
    if name.lower().endswith(".toml") or "/" in name or os.sep in name or name.startswith("~"):
        path = Path(name).expanduser()
        if path.is_file():
            return profile_from_toml(path)
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(f"profile file {name} {what}",
                          hint="give the path of a .toml profile (see `hisparse profiles show "
                               "cpu` for its fields) or a shipped profile name")
    raise ConfigError(f"unknown profile {name!r}; available: {', '.join(sorted(shipped))}",
                      hint="pick one of the listed profiles, 'auto', or a path to a .toml file")


def _card_tag_matches(profile_name: str, device_name: str) -> bool:
    """Does the card part of a profile name ("4090" of "4090-24g") name this device?

    Whole tokens only, so "a10" does not match "A100"; two adjacent tokens may join
    ("RTX 4060 Ti" → "4060ti").
    """
    tag = profile_name.split("-")[0].lower()
    tokens = [t for t in re.split(r"[^0-9a-z]+", device_name.lower()) if t]
    joined = {a + b for a, b in zip(tokens, tokens[1:])}
    return tag in tokens or tag in joined


def auto_profile_name(cuda_total_bytes: int | None, device_name: str | None = None,
                      profiles: list[HardwareProfile] | None = None) -> str:
    """Pure choice behind --profile auto.

    No CUDA (None) → "cpu". Otherwise, among GPU profiles whose VRAM budget fits in
    `cuda_total_bytes`: the one whose card tag names `device_name` if any (an A10 gets
    "a10-24g", not the same-sized "3090-24g"); else the largest budget (ties: alphabetical
    name); "cpu" when no GPU profile fits.
    """
    if cuda_total_bytes is None:
        return "cpu"
    candidates = [p for p in (profiles if profiles is not None else list_profiles())
                  if p.vram_budget_bytes is not None and p.vram_budget_bytes <= cuda_total_bytes]
    if not candidates:
        return "cpu"
    if device_name:
        named = sorted(p.name for p in candidates if _card_tag_matches(p.name, device_name))
        if named:
            return named[0]
    best = max(p.vram_budget_gib for p in candidates)  # type: ignore[type-var]
    return min(p.name for p in candidates if p.vram_budget_gib == best)


def detect_auto_profile() -> str:
    """auto_profile_name for this machine's first CUDA device (imports torch lazily)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    return auto_profile_name(int(props.total_memory), device_name=str(props.name))


__all__ = ["HardwareProfile", "load_profile", "list_profiles", "auto_profile_name",
           "detect_auto_profile", "profile_from_toml", "KV_DTYPES", "WEIGHT_FORMATS"]
