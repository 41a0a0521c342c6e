"""Causal self-attention with grouped-query heads, split by query groups over TP ranks.

The fused QKV weight is laid out per query group, [groups x (q_per_group + 2) x head_dim, hidden]
(Megatron-Core's layout), so a contiguous split over TP hands each rank whole groups with their
own queries, key and value: no communication inside attention. The core is torch's
scaled_dot_product_attention (flash/fused kernels where the device has them); with
`recompute == "selective"` only the core is recomputed in backward (its [b, heads, s, s]
intermediates are the largest activations and the cheapest to redo), with the same dropout mask.

Qwen-style options: a bias on the QKV projection alone (`add_qkv_bias`; it splits over TP with
the weight's rows, per query group), a head size other than hidden / heads (`kv_channels`), and
an RMSNorm (LayerNorm for GPT-2 style) of each query and key head over head_dim before RoPE
(`qk_layernorm`, Qwen3): one weight for q and one for k, shared by all heads and held whole by
every TP rank, each of which normalises its own heads, so their grads are summed over TP.

With a `kv_cache` (greedy decoding, engine/transformer/kv_cache.py) the step's keys and values
are written into this rank's groups of the cache and the queries attend the whole cache under
its mask (each query its own row's positions up to its own).

Under context parallelism (parallel.context > 1) the core is the CP ring attention of
engine.transformer.context_parallel over this rank's two sequence chunks; it keeps only q, k, v,
the output and its log-sum-exp for backward, so selective recompute has nothing to add there.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel_state as ps
from engine.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint, get_rng_tracker
from engine.transformer import context_parallel
from engine.transformer.config import TransformerConfig
from engine.transformer.kv_cache import LayerCache
from engine.transformer.norm import build_norm
from engine.transformer.rope import apply_rotary


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        self.config = config
        self.heads_local = config.num_attention_heads // tp
        self.groups_local = config.num_query_groups // tp
        self.q_per_group = config.num_attention_heads // config.num_query_groups
        # The CP core attention (None without context parallelism); the TE spec will pick "te".
        self.context_parallel = None
        if context_parallel.cp_size() > 1:  # attention dropout is refused by the job spec here
            self.context_parallel = context_parallel.core_attention_for_spec("local")
        hd = config.head_dim
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            (config.num_attention_heads + 2 * config.num_query_groups) * hd,
            bias=config.qkv_bias,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
            init_std=config.init_method_std,
            fp8=config.fp8,
        )
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * hd,
            config.hidden_size,
            bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
            init_std=config.output_layer_init_std,
            fp8=config.fp8,
        )
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm = build_norm(config, hd, per_head=True)
            self.k_layernorm = build_norm(config, hd, per_head=True)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """`attention_mask`: [b, 1, s, s] bool (True = attend) for packed rows, in place of the
        causal mask (engine.transformer.packed_seq); None: causal. With `kv_cache`, the cache's
        mask [b, 1, s, max_len]."""
        qkv = self.linear_qkv(x)  # [s, b, groups_local * (q_per_group + 2) * head_dim]
        s, b = qkv.shape[:2]
        hd = self.config.head_dim
        qkv = qkv.view(s, b, self.groups_local, self.q_per_group + 2, hd)
        q, k, v = qkv.split([self.q_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.heads_local, hd)
        k, v = k.squeeze(3), v.squeeze(3)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, head_dim]
        if kv_cache is not None:  # attend every cached position of the row, this step's too
            k, v = kv_cache.update(k, v)
        if self.config.recompute == "selective" and self.context_parallel is None:
            out = checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            out = self.core_attention(q, k, v, attention_mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * hd)
        return self.linear_proj(out)

    def core_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal or `attention_mask`) v with attention dropout;
        [b, heads, s, head_dim]."""
        if self.context_parallel is not None:  # packing is refused with CP by the job spec
            return self.context_parallel(q, k, v)
        p = self.config.attention_dropout if self.training else 0.0
        # Heads are split over TP, so their dropout masks must differ per rank.
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attention_mask,
                dropout_p=p,
                is_causal=attention_mask is None,
                enable_gqa=self.q_per_group > 1,
            )
