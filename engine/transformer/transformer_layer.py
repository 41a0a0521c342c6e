"""Pre-norm transformer layer and the block (stack of layers + final norm).

With `recompute == "full"` the block keeps only each layer's input and recomputes the layer in
backward (tensor_parallel.checkpoint, which replays the forward's dropout masks).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.tensor_parallel import checkpoint
from engine.transformer.attention import SelfAttention
from engine.transformer.config import TransformerConfig
from engine.transformer.dropout import dropout
from engine.transformer.kv_cache import KVCache, LayerCache
from engine.transformer.mla import MultiLatentAttention
from engine.transformer.mlp import MLP
from engine.transformer.moe import MoELayer
from engine.transformer.norm import build_norm


class TransformerLayer(nn.Module):
    """`moe`: the feed-forward block is a Mixture of Experts (same place and name: `mlp`)."""

    def __init__(self, config: TransformerConfig, moe: bool = False):
        super().__init__()
        self.config = config
        self.input_layernorm = build_norm(config)
        self.self_attention = MultiLatentAttention(config) if config.mla is not None else SelfAttention(config)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MoELayer(config, config.moe) if moe else MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: LayerCache | None = None,
    ) -> torch.Tensor:
        c = self.config
        y = self.self_attention(self.input_layernorm(x), rotary, attention_mask, kv_cache=kv_cache)
        x = x + dropout(y, c.hidden_dropout, self.training, c.sequence_parallel)
        y = self.mlp(self.pre_mlp_layernorm(x))
        return x + dropout(y, c.hidden_dropout, self.training, c.sequence_parallel)


class TransformerBlock(nn.Module):
    """`num_layers` consecutive layers (a pipeline stage's share; default all); the final norm
    only where the stack ends (`post_layer_norm`, the last pipeline stage)."""

    def __init__(
        self,
        config: TransformerConfig,
        num_layers: int | None = None,
        post_layer_norm: bool = True,
        layer_offset: int = 0,
    ):
        super().__init__()
        self.config = config
        count = config.num_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(
            TransformerLayer(config, moe=config.is_moe_layer(layer_offset + i)) for i in range(count)
        )
        self.final_layernorm = build_norm(config) if post_layer_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """`attention_mask`: packed rows' block-diagonal causal mask, or None (causal), or the
        KV cache's mask when decoding with `kv_cache`."""
        recompute = self.config.recompute == "full" and kv_cache is None
        for i, layer in enumerate(self.layers):
            if recompute:
                x = checkpoint(layer, x, rotary, attention_mask)
            else:
                x = layer(x, rotary, attention_mask, kv_cache.layer(i) if kv_cache is not None else None)
        return self.final_layernorm(x) if self.final_layernorm is not None else x
