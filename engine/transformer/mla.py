"""Multi-latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents.

    q      = up_q(norm_q(down_q(x)))             per head: [q_nope | q_rope]   (or one q projection)
    c, k_r = down_kv(x)                          c: the kv latent, k_r: one RoPE key for all heads
    k, v   = up_kv(norm_kv(c))                   per head: [k_nope], [v]
    attention over [q_nope | rope(q_rope)] . [k_nope | rope(k_r)], values v, softmax scale
    1/sqrt(qk_nope + qk_rope), then linear_proj.

Tensor parallelism splits heads (the up projections are column-parallel, linear_proj is
row-parallel); the down projections and their norms are small and replicated on every TP rank,
like Megatron-Core's. Their inputs are the layer input, so their gradients need the same care as
the norms': under sequence parallelism each rank projects its own sequence chunk (weights marked
`sequence_parallel`: grads summed over TP), and the decoupled RoPE key, which every head of every
rank uses, is gathered over the sequence (backward: reduce-scatter of the heads' partial grads);
without sequence parallelism every rank projects the whole sequence and the RoPE key's grad,
partial per rank (its own heads), is all-reduced on its way back.

Under context parallelism the core is the CP ring attention, which moves K and V as one tensor:
the narrower of (q, k) and v is zero-padded to the other's width (a zero key/query column
changes no score; queries are pre-scaled so the softmax scale stays 1/sqrt(nope + rope)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel_state as ps
from engine.parallel_placement import set_placement
from engine.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel
from engine.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from engine.transformer import context_parallel
from engine.transformer.config import TransformerConfig
from engine.transformer.norm import build_norm
from engine.transformer.rope import apply_rotary, mla_softmax_mscale


def _replicated_linear(config: TransformerConfig, inputs: int, outputs: int) -> nn.Parameter:
    weight = nn.Parameter(torch.empty(outputs, inputs, dtype=config.params_dtype))
    set_placement(weight, init_std=config.init_method_std)
    return weight


class MultiLatentAttention(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        c, mla = config, config.mla
        self.config, self.mla = config, mla
        self.softmax_mscale = mla_softmax_mscale(config.rope_scaling)
        tp = ps.get_tensor_model_parallel_world_size()
        self.heads_local = c.num_attention_heads // tp
        self.context_parallel = None
        if context_parallel.cp_size() > 1:
            self.context_parallel = context_parallel.core_attention_for_spec("local")
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        column = dict(
            sequence_parallel=c.sequence_parallel,
            params_dtype=c.params_dtype,
            init_std=c.init_method_std,
            fp8=c.fp8,
        )
        if mla.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(
                c.hidden_size, c.num_attention_heads * qk, bias=False, **column
            )
        else:
            self.linear_q_down_proj = nn.Module()
            self.linear_q_down_proj.weight = _replicated_linear(c, c.hidden_size, mla.q_lora_rank)
            mark_sequence_parallel(self.linear_q_down_proj, c.sequence_parallel)
            self.q_layernorm = build_norm(c, mla.q_lora_rank)
            self.linear_q_up_proj = ColumnParallelLinear(
                mla.q_lora_rank, c.num_attention_heads * qk, bias=False, **column
            )
        self.linear_kv_down_proj = nn.Module()
        self.linear_kv_down_proj.weight = _replicated_linear(
            c, c.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim
        )
        mark_sequence_parallel(self.linear_kv_down_proj, c.sequence_parallel)
        self.kv_layernorm = build_norm(c, mla.kv_lora_rank)
        self.linear_kv_up_proj = ColumnParallelLinear(
            mla.kv_lora_rank,
            c.num_attention_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            bias=False,
            **column,
        )
        self.linear_proj = RowParallelLinear(
            c.num_attention_heads * mla.v_head_dim,
            c.hidden_size,
            bias=False,
            sequence_parallel=c.sequence_parallel,
            params_dtype=c.params_dtype,
            init_std=c.output_layer_init_std,
            fp8=c.fp8,
        )

    def _context_parallel_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qk, vd = q.shape[-1], v.shape[-1]
        if vd < qk:
            return self.context_parallel(q, k, F.pad(v, (0, qk - vd)))[..., :vd]
        if vd > qk:
            q = F.pad(q * math.sqrt(vd / qk), (0, vd - qk))
            k = F.pad(k, (0, vd - qk))
        return self.context_parallel(q, k, v)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return self.linear_q_proj(x)
        return self.linear_q_up_proj(self.q_layernorm(F.linear(x, self.linear_q_down_proj.weight)))

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        kv_cache=None,
    ) -> torch.Tensor:
        """x: [s, b, h] (a sequence chunk under SP) -> [s, b, h]; `attention_mask` as SelfAttention's."""
        if kv_cache is not None:
            raise ValueError("model.mla: decoding with a KV cache is not built for multi-latent attention")
        mla, heads = self.mla, self.heads_local
        nope, rope, vd = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        q = self._queries(x)  # [S, b, heads_local * (nope + rope)]
        s, b = q.shape[:2]
        q_nope, q_rope = q.view(s, b, heads, nope + rope).split([nope, rope], dim=-1)
        latent, k_rope = F.linear(x, self.linear_kv_down_proj.weight).split([mla.kv_lora_rank, rope], dim=-1)
        if self.config.sequence_parallel:
            k_rope = gather_from_sequence_parallel_region(k_rope, True)
        elif ps.get_tensor_model_parallel_world_size() > 1:
            k_rope = copy_to_tensor_model_parallel_region(k_rope)
        kv = self.linear_kv_up_proj(self.kv_layernorm(latent)).view(s, b, heads, nope + vd)
        k_nope, v = kv.split([nope, vd], dim=-1)
        cos, sin = rotary
        q_rope = apply_rotary(q_rope, cos, sin)
        k_rope = apply_rotary(k_rope.unsqueeze(2), cos, sin).expand(s, b, heads, rope)
        q = torch.cat([q_nope, q_rope], dim=-1).permute(1, 2, 0, 3)  # [b, heads, s, nope + rope]
        if self.softmax_mscale != 1.0:  # YaRN's extra MLA scale, folded into the queries
            q = q * self.softmax_mscale
        k = torch.cat([k_nope, k_rope], dim=-1).permute(1, 2, 0, 3)
        v = v.permute(1, 2, 0, 3)
        if self.context_parallel is not None:
            out = self._context_parallel_core(q, k, v)
        elif attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, heads * vd))
