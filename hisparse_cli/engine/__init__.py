"""Engine: paged KV cache with sparse attention over our own Llama-family forward pass.

Public API: `Engine`, `SparseConfig`, `GenerationConfig`, `GenerationResult`, `RunStats`.
Imported lazily so `import hisparse_cli.engine` stays light until an attribute is used.
"""

from __future__ import annotations

from hisparse_cli.config.settings import GenerationConfig, SparseConfig

__all__ = ["Engine", "SparseConfig", "GenerationConfig", "GenerationResult", "RunStats"]


def __getattr__(name: str):
    if name in ("Engine", "GenerationResult", "RunStats"):
        from hisparse_cli.engine import engine as _engine

        return getattr(_engine, name)
    raise AttributeError(name)
