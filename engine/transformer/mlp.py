"""Feed-forward block: column-parallel up projection, activation, row-parallel down projection.

SwiGLU's gate and up projections are one fused weight [2 x ffn, hidden] with partition stride 2,
so each TP rank holds [gate_r; up_r] and the activation needs no communication.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from engine.transformer.activations import activation, is_gated
from engine.transformer.config import TransformerConfig


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig, ffn_hidden_size: int | None = None):
        super().__init__()
        self.activation = config.activation
        gated = is_gated(config.activation)
        ffn = ffn_hidden_size or config.ffn_hidden_size  # MoE's shared expert has its own width
        width = ffn * (2 if gated else 1)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            width,
            bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            partition_stride=2 if gated else 1,
            params_dtype=config.params_dtype,
            init_std=config.init_method_std,
            fp8=config.fp8,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            config.hidden_size,
            bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
            init_std=config.output_layer_init_std,
            fp8=config.fp8,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activation(self.linear_fc1(x), self.activation))
