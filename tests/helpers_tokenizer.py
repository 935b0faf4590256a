"""A tiny model folder for pipeline/CLI tests: conftest's random Llama + a trained tokenizer.

`make_tiny_model_dir(root)` writes a folder the engine and `resolve_model` accept
(config.json + model.safetensors + tokenizer files): a BPE tokenizer with a vocabulary of at
most 256 (the tiny model's), trained on the repository's own samples, with a small chat
template (or none, for the plain-prompt path). Outputs of the random model are gibberish;
the tests check plumbing (token budgets, chunking, stats, exit codes), not quality.
"""

from __future__ import annotations

from pathlib import Path

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 256


def _training_text() -> list[str]:
    texts = [p.read_text(encoding="utf-8") for p in sorted(SAMPLES.rglob("*"))
             if p.is_file() and p.suffix in (".txt", ".md", ".py", ".toml")]
    return texts or ["the quick brown fox jumps over the lazy dog"]


def build_tokenizer(chat_template: bool = True):
    """A PreTrainedTokenizerFast with vocab <= 256; ids 0/1/2 = unk/bos/eos (Llama's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  limit_alphabet=90, show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model_dir(root: Path, name: str = "tiny", *, chat_template: bool = True,
                        max_position_embeddings: int = 4096, seed: int = 0) -> Path:
    """Write a tiny random Llama + tokenizer into `root/name/llama`; returns that folder."""
    from conftest import save_tiny

    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    path, _ = save_tiny(folder, "llama", seed=seed, vocab_size=VOCAB_SIZE,
                        max_position_embeddings=max_position_embeddings,
                        bos_token_id=1, eos_token_id=2)
    build_tokenizer(chat_template).save_pretrained(path)
    return path
