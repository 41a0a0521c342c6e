"""Pre-norm transformer layer and the block (stack of layers + final norm)."""

from __future__ import annotations

import torch
from torch import nn

from engine.tensor_parallel import mark_sequence_parallel
from engine.transformer.attention import SelfAttention
from engine.transformer.config import TransformerConfig
from engine.transformer.dropout import dropout
from engine.transformer.mlp import MLP


def build_norm(config: TransformerConfig) -> nn.Module:
    """LayerNorm or RMSNorm; under sequence parallelism its params see one sequence chunk only."""
    if config.normalization == "RMSNorm":
        norm = nn.RMSNorm(config.hidden_size, eps=config.norm_epsilon, dtype=config.params_dtype)
    else:
        norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon, dtype=config.params_dtype)
    mark_sequence_parallel(norm, config.sequence_parallel)
    return norm


class TransformerLayer(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        c = self.config
        y = self.self_attention(self.input_layernorm(x), rotary)
        x = x + dropout(y, c.hidden_dropout, self.training, c.sequence_parallel)
        y = self.mlp(self.pre_mlp_layernorm(x))
        return x + dropout(y, c.hidden_dropout, self.training, c.sequence_parallel)


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.final_layernorm = build_norm(config)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, rotary)
        return self.final_layernorm(x)
