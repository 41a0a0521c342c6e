"""Rotary position embeddings (the "rotate half" convention of GPT-NeoX / Llama / Megatron-Core).

Frequency scaling for long contexts follows transformers' `modeling_rope_utils` operation for
operation (`_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
`_compute_yarn_parameters`), so a checkpoint trained there rotates its queries and keys here by
the same angles. YaRN also scales cos/sin by an attention factor (so q.k by its square), and
DeepSeek's multi-latent attention multiplies its softmax scale by mscale(factor, mscale_all_dim)^2
on top (`mla_softmax_mscale`).
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
    original / high_freq_factor, and blends in between; `yarn` interpolates the dimensions that
    turn fewer than beta_slow times over the original context, keeps those that turn more than
    beta_fast times, ramps in between, and scales attention (see the module docstring)."""

    type: str  # "linear" | "llama3" | "yarn"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """What YaRN multiplies cos and sin by (1 for every other kind)."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor)


def mla_softmax_mscale(scaling: RopeScaling | None) -> float:
    """DeepSeek's MLA under YaRN: its softmax scale times this (mscale(factor, mscale_all_dim)^2)."""
    if scaling is None or scaling.type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return _yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def _yarn_inverse_frequencies(head_dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        """The dimension that turns `rotations` times over the original context."""
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # 1: the dimension keeps its frequency (extrapolates), 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep


def inverse_frequencies(head_dim: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """base^(-2i/d) for i < d/2, in fp32, then scaled as `scaling` says."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "yarn":
        return _yarn_inverse_frequencies(head_dim, base, scaling)
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
        self.attention_factor = attention_factor(scaling)
        self._cache: dict[tuple[int, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [s, 1, 1, head_dim], to broadcast over [s, b, heads, head_dim]."""
        key = (seq_len, dtype, self.inv_freq.device)
        if key not in self._cache:
            pos = torch.arange(seq_len, dtype=torch.float32, device=self.inv_freq.device)
            freqs = torch.outer(pos, self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
            a = self.attention_factor
            self._cache[key] = ((emb.cos() * a).to(dtype), (emb.sin() * a).to(dtype))
        return self._cache[key]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
