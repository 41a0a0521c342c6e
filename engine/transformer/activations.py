"""The feed-forward activation shared by the dense MLP and the MoE experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activation(y: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """SwiGLU over a fused [gate | up] projection, or GELU (also the experts' activation)."""
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(y)
