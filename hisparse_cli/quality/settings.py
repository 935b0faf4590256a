"""Named sparse settings for evaluation: the spec language of `hisparse eval --settings`.

A spec names one `SparseConfig`, applied over a base config (the profile's):

    dense                                   the exact baseline (no window, no globals)
    profile                                 the base config itself
    w1024-g64                               short form: dash-separated tokens
    w512-g32-uniform                        ... a bare policy name sets `importance`
    window=1024,globals=64,importance=snapkv  key=value form (comma-separated)

Short tokens: w<N> window, g<N> globals, s<N> sinks, r<N> recalibrate_every,
k<N> recalibrate_topk, c<N> prefill_chunk, b<N> block_size, t<N> score_stride,
o<N> observation_window, q<N> retrieval_tokens, p<N> page_cache_tokens, and a policy name
(attention, snapkv, uniform, probe). The retrieval tier:
`window=256,globals=32,chunk=128,retrieval_tokens=256` (keys retrieval_tokens / retrieval,
page_cache_tokens / page_cache, retrieval_summary / summary = minmax | mean).
Keys of the key=value form: the SparseConfig field names and their aliases. Letters and
aliases are declared with each field (config/settings.py), so a new field needs no edit here.
When a spec sets the number of globals but not recalibrate_topk, the candidate pool follows
the global count (the profiles' convention: full turnover possible at each recalibration).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

from hisparse_cli.config.settings import IMPORTANCE_POLICIES, SparseConfig
from hisparse_cli.errors import ConfigError

# Both from each SparseConfig field's declaration (config/settings.py: `short`, `aliases`).
SHORT = {f.metadata["short"]: f.name for f in fields(SparseConfig) if f.metadata["short"]}
ALIASES = {alias: f.name for f in fields(SparseConfig) for alias in f.metadata["aliases"]}
_SHORT_RE = re.compile(r"^([a-z])(\d+)$")
HINT = ("use e.g. 'dense', 'w1024-g64', 'w512-g32-uniform' or "
        "'window=1024,globals=64,importance=snapkv'")


@dataclass(frozen=True)
class NamedSetting:
    """One evaluated setting: its spec string (the name in reports) and its config."""

    name: str
    sparse: SparseConfig

    @property
    def dense(self) -> bool:
        return self.sparse.dense


def _int(spec: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"setting {spec!r}: {key} needs a whole number, got {value!r}",
                          hint=HINT) from None


def _pairs(spec: str) -> dict[str, object]:
    declared = {f.name: f for f in fields(SparseConfig)}
    known = set(declared)
    out: dict[str, object] = {}
    if "=" in spec:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "=" not in part:
                raise ConfigError(f"setting {spec!r}: {part!r} is not key=value", hint=HINT)
            key, value = (x.strip() for x in part.split("=", 1))
            key = ALIASES.get(key, key)
            if key not in known:
                raise ConfigError(f"setting {spec!r}: unknown key {key!r}", hint=HINT)
            meta = declared[key].metadata
            if meta["choices"]:
                out[key] = value
            elif meta["optional"] and value.lower() in ("none", "dense"):
                out[key] = None
            else:
                out[key] = _int(spec, key, value)
        return out
    for token in filter(None, spec.split("-")):
        if token in IMPORTANCE_POLICIES:
            out["importance"] = token
            continue
        m = _SHORT_RE.match(token)
        if not m or m.group(1) not in SHORT:
            raise ConfigError(f"setting {spec!r}: cannot read {token!r}", hint=HINT)
        out[SHORT[m.group(1)]] = _int(spec, token, m.group(2))
    return out


def parse_setting(spec: str, base: SparseConfig | None = None) -> NamedSetting:
    """`spec` (module docstring) over `base` → NamedSetting. ConfigError names the problem."""
    base = base or SparseConfig()
    spec = spec.strip()
    if not spec:
        raise ConfigError("empty setting spec", hint=HINT)
    if spec == "dense":
        return NamedSetting("dense", SparseConfig.dense_config(
            block_size=base.block_size, prefill_chunk=base.prefill_chunk))
    if spec == "profile":
        return NamedSetting("profile", base)
    over = _pairs(spec)
    if "global_tokens" in over and "recalibrate_topk" not in over:
        over["recalibrate_topk"] = over["global_tokens"]
    return NamedSetting(spec, replace(base, **over))


def parse_settings(specs: list[str], base: SparseConfig | None = None) -> list[NamedSetting]:
    """Parse every spec; the dense baseline is put first (added when missing); duplicates of
    a name are refused."""
    out = [parse_setting(s, base) for s in specs]
    names = [s.name for s in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"setting(s) given twice: {', '.join(dup)}", hint=HINT)
    dense = [s for s in out if s.dense]
    if not dense:
        dense = [parse_setting("dense", base)]
    return dense[:1] + [s for s in out if not s.dense]


def describe(cfg: SparseConfig) -> str:
    """Compact one-line description of a config (reports)."""
    if cfg.dense:
        return "dense"
    text = (f"sinks {cfg.sink_tokens}, window {cfg.window_size}, globals {cfg.global_tokens} "
            f"({cfg.importance}), recal {cfg.recalibrate_every}/top{cfg.recalibrate_topk}, "
            f"chunk {cfg.prefill_chunk}")
    if cfg.retrieval:
        text += (f", retrieval {cfg.retrieval_tokens} ({cfg.retrieval_summary}, page cache "
                 f"{cfg.page_cache_pages * cfg.block_size})")
    return text


__all__ = ["NamedSetting", "parse_setting", "parse_settings", "describe"]
