"""The feed-forward activation shared by the dense MLP and the MoE experts, by name
(TransformerConfig.activation), so both always apply the same one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")


def activation(y: torch.Tensor, name: str) -> torch.Tensor:
    """swiglu: SiLU(gate) * up over a fused [gate | up] projection; gelu: the exact (erf) GeLU;
    gelu_tanh: its tanh approximation (GPT-2's `gelu_new`)."""
    if name == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    if name == "gelu":
        return F.gelu(y)
    if name == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}: one of {', '.join(ACTIVATIONS)}")


def is_gated(name: str) -> bool:
    """Whether the first projection is a fused [gate | up] pair (twice the ffn width)."""
    return name == "swiglu"
