"""Model resolution: the embedded default model, pulling/converting it, and `--model` lookup.

Public API (none of these modules imports torch or transformers at import time):
    resolve_model(spec, *, auto_pull=True, progress=None) -> Path        resolve.py
    pull_model(name, *, progress=None, force=False) -> Path              pull.py
    list_models() / model_path(name) / remove_model(name, ...)           manage.py
    ModelSpec, REGISTRY, DEFAULT_MODEL, hisparse_home()                  registry.py
"""

from hisparse_cli.hub.manage import ModelInfo, list_models, model_path, remove_model
from hisparse_cli.hub.pull import pull_model
from hisparse_cli.hub.registry import DEFAULT_MODEL, REGISTRY, ModelSpec, get_spec, hisparse_home
from hisparse_cli.hub.resolve import resolve_model

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "ModelInfo",
    "ModelSpec",
    "get_spec",
    "hisparse_home",
    "list_models",
    "model_path",
    "pull_model",
    "remove_model",
    "resolve_model",
]
