"""Rotary position embeddings (the "rotate half" convention of GPT-NeoX / Llama / Megatron-Core)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..s-1, computed in fp32 and cached per length."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: dict[tuple[int, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [s, 1, 1, head_dim], to broadcast over [s, b, heads, head_dim]."""
        key = (seq_len, dtype, self.inv_freq.device)
        if key not in self._cache:
            pos = torch.arange(seq_len, dtype=torch.float32, device=self.inv_freq.device)
            freqs = torch.outer(pos, self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
            self._cache[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._cache[key]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
