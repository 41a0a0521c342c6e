"""Rotary position embeddings (the "rotate half" convention of GPT-NeoX / Llama / Megatron-Core).

Frequency scaling for long contexts follows transformers' `modeling_rope_utils` operation for
operation (`_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`), so a
checkpoint trained there rotates its queries and keys here by the same angles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RopeScaling:
    """model.rope_scaling: `linear` divides every inverse frequency by `factor`; `llama3` only
    those whose wavelength exceeds original / low_freq_factor, keeps those below
    original / high_freq_factor, and blends in between."""

    type: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def inverse_frequencies(head_dim: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """base^(-2i/d) for i < d/2, in fp32, then scaled as `scaling` says."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type != "llama3":
        raise ValueError(f"unknown rope scaling type {scaling.type!r}")
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..s-1, computed in fp32 and cached per length."""

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: RopeScaling | None = None):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, base, scaling), persistent=False)
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
