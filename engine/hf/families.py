"""Per-family tensor mapping between a Hugging Face causal LM and our GPTModel's global names.

Our names are `GPTModel.global_param_name`'s (layer numbers global, tied output = embedding).
Fused tensors use Megatron-Core's layouts:

- `linear_qkv.weight` is [groups x (q_per_group + 2) x head_dim, hidden]: per query group its
  queries, then its key, then its value, so a TP shard is a contiguous block of whole groups and
  reads contiguous row ranges of HF's q_proj / k_proj / v_proj (`qkv_source_rows`);
- `linear_fc1.weight` is [gate; up] with partition_stride 2: TP rank r holds gate shard r then up
  shard r.

The config.json side of a family is engine/jobspec/hf_config.py (plain json, usable by the API).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Our per-layer name suffix -> the HF per-layer suffix(es), for the Llama-style families
# (Llama 2/3, Mistral; Qwen2 adds q/k/v biases, Qwen3 q_norm/k_norm, once ModelSpec has them).
LLAMA_LAYER: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
LLAMA_GLOBAL: dict[str, str] = {
    "embedding.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class Heads:
    num_attention_heads: int
    num_query_groups: int
    head_dim: int

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


def hf_names(our_name: str, tie_embeddings: bool) -> tuple[str, ...]:
    """The HF tensors one of our global parameters is made of (in fused order)."""
    if our_name.startswith("decoder.layers."):
        idx, _, suffix = our_name[len("decoder.layers.") :].partition(".")
        if suffix not in LLAMA_LAYER:
            raise KeyError(f"no Hugging Face tensor maps to {our_name}")
        return tuple(f"model.layers.{idx}.{s}" for s in LLAMA_LAYER[suffix])
    if our_name == "output_layer.weight" and tie_embeddings:
        return (LLAMA_GLOBAL["embedding.weight"],)
    if our_name not in LLAMA_GLOBAL:
        raise KeyError(f"no Hugging Face tensor maps to {our_name}")
    return (LLAMA_GLOBAL[our_name],)


def qkv_source_rows(h: Heads, groups: range) -> tuple[slice, slice, slice]:
    """Rows of HF's q_proj, k_proj, v_proj that query groups `groups` (contiguous) need."""
    g0, g1, d = groups.start, groups.stop, h.head_dim
    q = slice(g0 * h.q_per_group * d, g1 * h.q_per_group * d)
    kv = slice(g0 * d, g1 * d)
    return q, kv, kv


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: Heads) -> torch.Tensor:
    """HF q/k/v rows (for some whole groups) -> our fused [groups x (q_per_group+2) x d, hidden]."""
    d, hidden = h.head_dim, q.shape[-1]
    groups = k.shape[0] // d
    fused = torch.cat(
        [q.reshape(groups, h.q_per_group, d, hidden), k.reshape(groups, 1, d, hidden), v.reshape(groups, 1, d, hidden)],
        dim=1,
    )
    return fused.reshape(groups * (h.q_per_group + 2) * d, hidden)


def unpack_qkv(fused: torch.Tensor, h: Heads) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused QKV -> HF's q_proj, k_proj, v_proj (inverse of `pack_qkv`)."""
    d, hidden = h.head_dim, fused.shape[-1]
    groups = fused.shape[0] // ((h.q_per_group + 2) * d)
    q, k, v = fused.reshape(groups, h.q_per_group + 2, d, hidden).split([h.q_per_group, 1, 1], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def pack_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate_proj / up_proj (full, or one TP rank's shard of each) -> our fc1 [gate; up]."""
    return torch.cat([gate, up], dim=0)


def unpack_fc1(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate, up
