"""T5's layers and stacks: pre-norm with T5's RMS-style LayerNorm (no mean, no bias: torch's
RMSNorm), gated-GELU feed-forward (T5 v1.1), self-attention with the stack's relative position
bias, and in the decoder a cross-attention block between the two.

A stack (encoder or decoder) owns its relative position table (transformers keeps it in the
first layer's attention; the Hugging Face mapping, engine/hf/t5.py, names it so). Here it is a
module of the stack, computed once before the layers and handed to each: every layer returns a
single tensor, which is what full recompute and parameter sharding's per-layer units
(engine/distributed/param_gather.py) work with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel_state as ps
from engine.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint
from engine.transformer.config import TransformerConfig
from engine.transformer.dropout import dropout
from engine.transformer.norm import build_norm
from engine.transformer.t5_attention import (
    RelativePositionBias,
    T5CrossAttention,
    T5SelfAttention,
    additive_mask,
)


class T5MLP(nn.Module):
    """wo(gelu_new(wi_0 x) * wi_1 x): one fused [gate; up] weight split with stride 2 over TP."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = config
        self.linear_fc1 = ColumnParallelLinear(
            c.hidden_size,
            2 * c.ffn_hidden_size,
            bias=False,
            sequence_parallel=c.sequence_parallel,
            partition_stride=2,
            params_dtype=c.params_dtype,
            init_std=c.init_method_std,
        )
        self.linear_fc2 = RowParallelLinear(
            c.ffn_hidden_size,
            c.hidden_size,
            bias=False,
            sequence_parallel=c.sequence_parallel,
            params_dtype=c.params_dtype,
            init_std=c.output_layer_init_std,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.gelu(gate, approximate="tanh") * up)


class T5Layer(nn.Module):
    """An encoder layer, or with `cross_attention` a decoder layer."""

    def __init__(self, config: TransformerConfig, cross_attention: bool):
        super().__init__()
        self.config = config
        self.input_layernorm = build_norm(config)
        self.self_attention = T5SelfAttention(config)
        self.pre_cross_attn_layernorm = self.cross_attention = None
        if cross_attention:
            self.pre_cross_attn_layernorm = build_norm(config)
            self.cross_attention = T5CrossAttention(config)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = T5MLP(config)

    def _residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        c = self.config
        return x + dropout(y, c.hidden_dropout, self.training, c.sequence_parallel)

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor,
        encoder_output: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self._residual(x, self.self_attention(self.input_layernorm(x), bias))
        if self.cross_attention is not None:
            x = self._residual(x, self.cross_attention(self.pre_cross_attn_layernorm(x), encoder_output, cross_mask))
        return self._residual(x, self.mlp(self.pre_mlp_layernorm(x)))


class T5Stack(nn.Module):
    """`num_layers` layers, the stack's relative position table and its final norm. The encoder
    attends both ways (with the padding mask), the decoder causally and across to the encoder."""

    def __init__(self, config: TransformerConfig, num_layers: int, decoder: bool):
        super().__init__()
        self.config, self.is_decoder = config, decoder
        self.relative_attention_bias = RelativePositionBias(config, bidirectional=not decoder)
        self.layers = nn.ModuleList(T5Layer(config, cross_attention=decoder) for _ in range(num_layers))
        self.final_layernorm = build_norm(config)

    def forward(
        self,
        x: torch.Tensor,
        padding: torch.Tensor | None = None,
        encoder_output: torch.Tensor | None = None,
        encoder_padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [s, b, h] (a chunk [s/tp, b, h] under SP). `padding`: the encoder's [b, s] bool mask
        (True = a token), None: none; the decoder is causal and its keys' padding only ever
        meets padded queries, whose labels take no loss. `encoder_output` and `encoder_padding`:
        what the decoder's cross-attention reads."""
        c = self.config
        seq = x.shape[0] * (ps.get_tensor_model_parallel_world_size() if c.sequence_parallel else 1)
        bias = self.relative_attention_bias(seq, seq)  # [1, heads/tp, s, s]
        if self.is_decoder:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            bias = bias + additive_mask(causal, bias.dtype)
        elif padding is not None:
            bias = bias + additive_mask(padding.bool()[:, None, None, :], bias.dtype)
        cross = None
        if encoder_padding is not None:
            cross = additive_mask(encoder_padding.bool()[:, None, None, :], x.dtype)
        for layer in self.layers:
            if c.recompute == "full":
                x = checkpoint(layer, x, bias, encoder_output, cross)
            else:
                x = layer(x, bias, encoder_output, cross)
        x = self.final_layernorm(x)
        return dropout(x, c.hidden_dropout, self.training, c.sequence_parallel)
