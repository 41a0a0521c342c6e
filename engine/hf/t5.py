"""The Hugging Face T5 family's tensors (hf_families.py) <-> our T5Model's global names (engine/models/t5.py), as
`Segment`s for the shared import/export code (engine/hf/families.py, importer.py, exporter.py).

transformers keeps each stack's relative position table in its first block's self-attention
(`{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight`, [buckets, heads]); ours
is the stack's own module, and TP splits its columns (heads). A decoder block's sub-layers are
layer.0 self-attention, layer.1 cross-attention (EncDecAttention), layer.2 feed-forward; an
encoder block has no cross-attention, so its feed-forward is layer.1. The fused tensors use the
same layouts as the other families: self-attention QKV per head [q; k; v] (one query per group),
cross-attention KV per head [k; v], the gated MLP [wi_0 (gate); wi_1 (up)].

The shared embedding is `shared.weight`; the decoder stage's copy under pipeline parallelism is
the same global name. A tied model has no `lm_head.weight` (transformers 5 writes only
`shared.weight`; a folder that carries the copies, `encoder.embed_tokens.weight` and
`decoder.embed_tokens.weight`, or a tied `lm_head.weight`, imports with them unread).
"""

from __future__ import annotations

import re
from typing import Any

from engine.hf.segment import Segment, grouped_qkv, vocab, whole

# Copies of shared.weight some T5 folders carry, and a table transformers itself never reads.
UNREAD = (
    "encoder.embed_tokens.weight",
    "decoder.embed_tokens.weight",
    "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
)

_LAYER = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(.+)$")


def _kv(k: str, v: str, heads: Any) -> list[Segment]:
    d = heads.head_dim
    out = []
    for h in range(heads.num_attention_heads):
        out += [Segment(k, h * d, d), Segment(v, h * d, d)]
    return out


def _layer(stack: str, index: str, suffix: str, s: Any) -> list[Segment]:
    block = f"{stack}.block.{index}.layer"
    decoder = stack == "decoder"
    ff = f"{block}.{2 if decoder else 1}"
    attn, cross = f"{block}.0.SelfAttention", f"{block}.1.EncDecAttention"
    hidden = s.hidden_size
    table = {
        "input_layernorm.weight": whole(f"{block}.0.layer_norm.weight", hidden),
        "self_attention.linear_qkv.weight": grouped_qkv(
            f"{attn}.q.weight", f"{attn}.k.weight", f"{attn}.v.weight", s.heads
        ),
        "self_attention.linear_proj.weight": whole(f"{attn}.o.weight", hidden),
        "pre_mlp_layernorm.weight": whole(f"{ff}.layer_norm.weight", hidden),
        "mlp.linear_fc1.weight": [
            Segment(f"{ff}.DenseReluDense.wi_0.weight", 0, s.ffn_hidden_size),
            Segment(f"{ff}.DenseReluDense.wi_1.weight", 0, s.ffn_hidden_size),
        ],
        "mlp.linear_fc2.weight": whole(f"{ff}.DenseReluDense.wo.weight", hidden),
    }
    if decoder:
        heads = s.heads
        table.update(
            {
                "pre_cross_attn_layernorm.weight": whole(f"{block}.1.layer_norm.weight", hidden),
                "cross_attention.linear_q.weight": whole(
                    f"{cross}.q.weight", heads.num_attention_heads * heads.head_dim
                ),
                "cross_attention.linear_kv.weight": _kv(f"{cross}.k.weight", f"{cross}.v.weight", heads),
                "cross_attention.linear_proj.weight": whole(f"{cross}.o.weight", hidden),
            }
        )
    if suffix in table:
        return table[suffix]
    raise KeyError(suffix)


def t5_segments(our_name: str, s: Any) -> list[Segment]:
    """Our global tensor `our_name` as segments of the T5 family's tensors; KeyError for none."""
    m = _LAYER.match(our_name)
    if m:
        return _layer(*m.groups(), s)
    for stack in ("encoder", "decoder"):
        if our_name == f"{stack}.relative_attention_bias.weight":
            return [Segment(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", 0, -1)]
        if our_name == f"{stack}.final_layernorm.weight":
            return whole(f"{stack}.final_layer_norm.weight", s.hidden_size)
    if our_name == "embedding.weight" or (our_name == "output_layer.weight" and s.tie_embeddings):
        return vocab("shared.weight", s)
    if our_name == "output_layer.weight":
        return vocab("lm_head.weight", s)
    raise KeyError(our_name)
