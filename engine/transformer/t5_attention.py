"""T5's attention: relative position buckets, an additive bias, no 1/sqrt(d) scaling, and the
decoder's cross-attention over the encoder output.

T5 folds the softmax's 1/sqrt(head_dim) into its initialisation, so the core is
scaled_dot_product_attention with scale=1.0 and one additive float mask: the relative position
bias (bidirectional buckets in the encoder, causal ones in the decoder), plus the padding and
causal masks as the dtype's lowest value (as transformers does: a row never becomes all -inf,
so no NaN). Heads are split over TP ranks like the other attentions: the fused QKV weight is
[heads x 3 x head_dim, hidden] (Megatron-Core's per-group layout with one query per group),
cross-attention's K/V weight [heads x 2 x head_dim, hidden], and each TP rank holds the
relative bias columns of its own heads. Under sequence parallelism the linears gather the
sequence (the encoder output too, for cross-attention's keys and values), so the bias is always
over whole sequences.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel_state as ps
from engine.parallel_placement import set_placement
from engine.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint, get_rng_tracker
from engine.transformer.config import TransformerConfig


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each (key position - query position), exactly as transformers (and Mesh
    TensorFlow) computes it: half the buckets exact small distances, the rest logarithmic up to
    `max_distance`; bidirectional uses half the buckets per direction, causal only the past."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (
        torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, large)


class RelativePositionBias(nn.Module):
    """The [buckets, heads] table of one stack (T5 keeps it in the stack's first layer and reuses
    it in every layer); this TP rank holds its heads' columns. Gives [1, heads/tp, sq, sk]."""

    def __init__(self, config: TransformerConfig, bidirectional: bool):
        super().__init__()
        t5 = config.t5
        tp = ps.get_tensor_model_parallel_world_size()
        heads = config.num_attention_heads
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = t5.relative_attention_num_buckets, t5.relative_attention_max_distance
        self.weight = nn.Parameter(torch.empty(self.num_buckets, heads // tp, dtype=config.params_dtype))
        set_placement(self.weight, shape=(self.num_buckets, heads), tp_dim=1, init_std=config.init_method_std)

    def forward(self, query_length: int, key_length: int) -> torch.Tensor:
        device = self.weight.device
        context = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        bucket = relative_position_bucket(memory - context, self.bidirectional, self.num_buckets, self.max_distance)
        return F.embedding(bucket, self.weight).permute(2, 0, 1).unsqueeze(0)


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (True = attend) -> 0 where kept, the dtype's lowest value elsewhere."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


class _T5AttentionBase(nn.Module):
    """The output projection and the core, shared by self- and cross-attention."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        self.config = config
        self.heads_local = config.num_attention_heads // tp
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=False,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
            init_std=config.output_layer_init_std,
        )

    def _linear(self, out_features: int) -> ColumnParallelLinear:
        c = self.config
        return ColumnParallelLinear(
            c.hidden_size,
            out_features,
            bias=False,
            sequence_parallel=c.sequence_parallel,
            params_dtype=c.params_dtype,
            init_std=c.init_method_std,
        )

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """q [sq, b, heads, d], k/v [sk, b, heads, d], bias broadcastable to [b, heads, sq, sk] ->
        the projected output [sq, b, h] (a sequence chunk under SP)."""
        sq, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if self.config.recompute == "selective":
            out = checkpoint(self.core_attention, q, k, v, bias)
        else:
            out = self.core_attention(q, k, v, bias)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(sq, b, -1))

    def core_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """softmax(q k^T + bias) v, unscaled (T5), with attention dropout; [b, heads, s, d]."""
        p = self.config.attention_dropout if self.training else 0.0
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias.to(q.dtype), dropout_p=p, scale=1.0)


class T5SelfAttention(_T5AttentionBase):
    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.linear_qkv = self._linear(3 * config.num_attention_heads * config.head_dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """`bias`: the relative position bias plus the padding / causal mask, additive."""
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, self.heads_local, 3, self.config.head_dim).unbind(3)
        return self._attend(q, k, v, bias)


class T5CrossAttention(_T5AttentionBase):
    """Queries from the decoder, keys and values from the encoder output (no position bias)."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.linear_q = self._linear(config.num_attention_heads * config.head_dim)
        self.linear_kv = self._linear(2 * config.num_attention_heads * config.head_dim)

    def forward(self, x: torch.Tensor, encoder_output: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """`mask`: the encoder's padding as an additive [b, 1, 1, s_enc] mask (None: no padding)."""
        d = self.config.head_dim
        q = self.linear_q(x)
        q = q.view(*q.shape[:2], self.heads_local, d)
        kv = self.linear_kv(encoder_output)
        k, v = kv.view(*kv.shape[:2], self.heads_local, 2, d).unbind(3)
        return self._attend(q, k, v, mask)
