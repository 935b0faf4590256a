"""Evaluation documents and the token layout every setting is scored on.

    docs = load_eval_documents([dir_or_file, ...])   # <id>.txt (+ <id>.ref.txt when present)
    layout = build_layout(doc_ids, LayoutConfig(max_tokens=3072))

Layout of the teacher-forced sequence (the same tokens for dense and every sparse setting):

    [ document tokens 0 .. n_doc-1 ][ passage: doc[a : a+P] repeated ]
      scored region: positions >= score_from * n_doc        a = n_doc // 10 (early)

* fidelity (KL, top-1, perplexity) is scored on next-token predictions inside the document's
  scored region (the later part, where the sparse set has evicted history);
* attention recall is sampled at `recall_queries` evenly spaced positions of that region;
* long-range retention: the perplexity of the repeated passage (after its first `skip`
  tokens, which cue the copy) — a dense model copies it from far back; a sparse run can only
  if the passage survived as sinks, window or globals.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from hisparse_cli.errors import InputError

REF_SUFFIXES = (".ref.txt", ".ref-alt.txt")


@dataclass(frozen=True)
class EvalDocument:
    id: str
    text: str
    reference: str | None
    genre: str = "generic"
    title: str = ""
    source: str = ""


def _is_reference(path: Path) -> bool:
    return any(path.name.endswith(s) for s in REF_SUFFIXES)


def _read_reference(path: Path) -> str | None:
    """<id>.ref.txt decoded like a text document (a BOM, else UTF-8, else cp1252; an empty one
    is no reference); InputError when it cannot be read."""
    from hisparse_cli.documents.text import decode_bytes

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read reference {path}: {exc.strerror or exc}",
                         hint="give a readable plain-text <id>.ref.txt, or remove it") from None
    return decode_bytes(data)[0] if data.strip() else None


def _load_one(path: Path, password: str | None = None) -> EvalDocument:
    from hisparse_cli.documents import load_document

    doc = load_document(path, password=password)
    stem = path.name[: -len(path.suffix)] if path.suffix else path.name
    ref_path = path.with_name(stem + ".ref.txt")
    ref = _read_reference(ref_path) if ref_path.is_file() else None
    return EvalDocument(id=stem, text=doc.text, reference=ref if ref and ref.strip() else None,
                        genre=doc.genre, title=doc.title, source=str(path))


def load_eval_documents(paths: list[str | Path],
                        password: str | None = None) -> list[EvalDocument]:
    """Documents from files and folders (folders: every *.txt below, references excluded);
    `password` opens encrypted PDFs."""
    files: list[Path] = []
    for p in map(Path, paths):
        p = p.expanduser()
        if p.is_dir():
            files += sorted(f for f in p.rglob("*.txt") if not _is_reference(f))
        elif p.is_file():
            files.append(p)
        else:
            raise InputError(f"{p}: no such file or directory",
                             hint="give text files or folders of <id>.txt (+ <id>.ref.txt)")
    if not files:
        raise InputError("no documents to evaluate", hint="folders must hold *.txt documents")
    docs = [_load_one(f, password) for f in files]
    ids = [d.id for d in docs]
    return [replace(d, id=f"{Path(d.source).parent.name}/{d.id}") if ids.count(d.id) > 1 else d
            for d in docs]


def truncate_text(tokenizer, text: str, max_tokens: int) -> str:
    """The longest prefix of `text` that tokenizes to at most `max_tokens` tokens."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if len(ids) <= max_tokens:
        return text
    offsets = enc.get("offset_mapping")
    if offsets:
        return text[: offsets[max_tokens][0]]
    return tokenizer.decode(ids[:max_tokens])


@dataclass(frozen=True)
class LayoutConfig:
    max_tokens: int = 3072  # total teacher-forced tokens (document + repeated passage)
    score_from: float = 0.5  # scored region starts at this fraction of the document
    recall_queries: int = 64
    passage_tokens: int = 96  # 0 disables the retention probe
    passage_skip: int = 8

    def __post_init__(self) -> None:
        if not 0.0 <= self.score_from < 1.0:
            raise ValueError(f"score_from must be in [0, 1), got {self.score_from}")
        if self.passage_skip >= max(self.passage_tokens, 1) and self.passage_tokens:
            raise ValueError("passage_skip must be smaller than passage_tokens")


@dataclass(frozen=True)
class Layout:
    ids: list[int]
    n_doc: int
    passage_start: int
    passage_len: int
    score_positions: list[int]  # logits here predict ids[p + 1] (inside the document)
    recall_positions: list[int]
    retention_positions: list[int]  # logits here predict repeated-passage tokens

    def targets(self, positions: list[int]) -> list[int]:
        return [self.ids[p + 1] for p in positions]


def build_layout(doc_ids: list[int], cfg: LayoutConfig) -> Layout:
    p_len = cfg.passage_tokens if len(doc_ids) >= 4 * cfg.passage_tokens > 0 else 0
    n_doc = min(len(doc_ids), cfg.max_tokens - p_len)
    if n_doc < 2:
        raise InputError("a document needs at least 2 tokens to be scored")
    start = max(16, n_doc // 10) if p_len else 0
    ids = list(doc_ids[:n_doc]) + list(doc_ids[start:start + p_len])
    lo = min(int(n_doc * cfg.score_from), n_doc - 2)
    score = list(range(lo, n_doc - 1))
    span = n_doc - lo
    count = max(1, min(cfg.recall_queries, span))
    recall = sorted({lo + (i * (span - 1)) // max(count - 1, 1) for i in range(count)})
    retention = [n_doc + j - 1 for j in range(cfg.passage_skip, p_len)] if p_len else []
    return Layout(ids=ids, n_doc=n_doc, passage_start=start, passage_len=p_len,
                  score_positions=score, recall_positions=recall, retention_positions=retention)


__all__ = ["EvalDocument", "load_eval_documents", "truncate_text", "LayoutConfig", "Layout",
           "build_layout"]
