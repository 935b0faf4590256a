"""Quality check for quantized models: held-out perplexity with our own forward pass.

`split_texts` cuts every calibration document into a head (calibration) and a tail
(held out), at a line break, so the evaluation text is never seen by the search.
"""

from __future__ import annotations

import math

import torch


def split_texts(texts: list[str], calib_fraction: float = 0.75) -> tuple[list[str], list[str]]:
    """Each text -> (head, tail) at the first line break after calib_fraction of its length."""
    heads, tails = [], []
    for text in texts:
        cut = text.find("\n", int(len(text) * calib_fraction))
        cut = len(text) if cut < 0 else cut
        if text[:cut].strip():
            heads.append(text[:cut])
        if text[cut:].strip():
            tails.append(text[cut:])
    return heads, tails


def token_windows(tokenizer, texts: list[str], seq_len: int) -> list[torch.Tensor]:
    """Each text tokenized on its own, cut into windows of at most seq_len (>= 2) tokens."""
    windows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        for s in range(0, len(ids), seq_len):
            if len(ids[s:s + seq_len]) >= 2:
                windows.append(torch.tensor(ids[s:s + seq_len], dtype=torch.long))
    return windows


@torch.inference_mode()
def perplexity(model, windows: list[torch.Tensor]) -> tuple[float, int]:
    """exp(mean next-token NLL) over all windows (dense causal forward); (ppl, tokens scored)."""
    from hisparse_cli.model.llama import forward_full

    nll, count = 0.0, 0
    device = next(model.parameters()).device
    for ids in windows:
        ids = ids.to(device)
        logits = forward_full(model, ids).float()  # [T, V]
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
        count += ids.numel() - 1
    return math.exp(nll / max(1, count)), count
