"""`HostEmbedding`: the input embedding table kept in host memory (tight-VRAM option).

A 128K-vocabulary, 4096-wide table is 1 GiB in fp16, about a sixth of a 6 GiB card. Only
the rows of the tokens being processed are needed on the GPU, so the table stays in (pinned,
when CUDA is present) host memory: gather the rows on the CPU, then copy those [T, hidden]
rows to the compute device. State-dict key stays `weight`, so checkpoints load unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


class HostEmbedding(nn.Module):
    """Embedding whose table lives on the CPU; outputs land on `device` in `dtype`."""

    def __init__(self, weight: torch.Tensor, device: str | torch.device,
                 dtype: torch.dtype | None = None, pin: bool | None = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.dtype = dtype or weight.dtype
        w = weight.detach().to("cpu", dtype=self.dtype).contiguous()  # [V, hidden]
        if pin is None:
            pin = self.device.type == "cuda"
        if pin:
            w = w.pin_memory()
        self.weight = nn.Parameter(w, requires_grad=False)
        self.num_embeddings, self.embedding_dim = w.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] (any device) -> [..., hidden] on self.device."""
        rows = self.weight.index_select(0, ids.reshape(-1).to("cpu"))  # [N, hidden] host
        rows = rows.view(*ids.shape, self.embedding_dim)
        if self.device.type == "cpu":
            return rows
        if self.weight.is_pinned():
            rows = rows.pin_memory()  # staging copy so the host->device copy is asynchronous
            return rows.to(self.device, non_blocking=True)
        return rows.to(self.device)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, host={self.weight.device}, "
                f"out={self.device}, dtype={self.dtype}")
