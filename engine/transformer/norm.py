"""The model's normalisation (LayerNorm or RMSNorm), over the hidden size or, for Qwen3's
per-head q/k norms, over one head.

Norm weights are replicated over TP. Their gradient is a partial sum over the TP ranks, which
finalize_model_grads completes (params marked `sequence_parallel`), when each rank saw only part
of what the norm normalised: a sequence chunk under sequence parallelism (the layer norms), or
its own heads (the q/k norms, whatever the sequence layout).
"""

from __future__ import annotations

from torch import nn

from engine.tensor_parallel import mark_sequence_parallel
from engine.transformer.config import TransformerConfig


def build_norm(config: TransformerConfig, size: int | None = None, *, per_head: bool = False) -> nn.Module:
    """A norm over `size` (default hidden_size); `per_head`: a q/k norm (grads summed over TP always)."""
    cls = nn.RMSNorm if config.normalization == "RMSNorm" else nn.LayerNorm
    norm = cls(size or config.hidden_size, eps=config.norm_epsilon, dtype=config.params_dtype)
    mark_sequence_parallel(norm, per_head or config.sequence_parallel)
    return norm
