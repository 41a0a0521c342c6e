"""The BERT masked-LM family's tensors <-> our BertModel's global names (engine/models/bert.py), as
Segments for engine/hf/families.py, which drives import and export for every family.

Our fused QKV is per head [q_h; k_h; v_h] (Megatron-Core's grouped layout with one query group
per head), read from HF's separate query / key / value rows; the word embedding and the MLM
decoder's bias carry the vocabulary padding; the decoder weight is the embedding (tied, as
transformers saves it: only `cls.predictions.bias` is stored) unless the model is untied.
"""

from __future__ import annotations

import re

from engine.hf.segment import Segment, Shapes, grouped_qkv, vocab

_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")

_OWN = {  # ours -> HF, outside the layers (None rows: the HF tensor's own length)
    "position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "tokentype_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
    "embedding_layernorm.weight": "bert.embeddings.LayerNorm.weight",
    "embedding_layernorm.bias": "bert.embeddings.LayerNorm.bias",
    "lm_head.dense.weight": "cls.predictions.transform.dense.weight",
    "lm_head.dense.bias": "cls.predictions.transform.dense.bias",
    "lm_head.layernorm.weight": "cls.predictions.transform.LayerNorm.weight",
    "lm_head.layernorm.bias": "cls.predictions.transform.LayerNorm.bias",
    "binary_head.pooler.weight": "bert.pooler.dense.weight",  # the pretraining family's next-sentence head
    "binary_head.pooler.bias": "bert.pooler.dense.bias",
    "binary_head.classifier.weight": "cls.seq_relationship.weight",
    "binary_head.classifier.bias": "cls.seq_relationship.bias",
}

_IN_LAYER = {
    "self_attention.linear_proj": "attention.output.dense",
    "post_attention_layernorm": "attention.output.LayerNorm",
    "mlp.linear_fc1": "intermediate.dense",
    "mlp.linear_fc2": "output.dense",
    "post_mlp_layernorm": "output.LayerNorm",
}

# What a BERT masked-LM file may hold besides what we read: the tied decoder's copies (older
# transformers saved them).
TIED_COPIES = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


def bert_segments(our_name: str, s: Shapes) -> list[Segment]:
    """Our global tensor `our_name` as the BERT family's segments; KeyError for one it lacks."""
    m = _LAYER.match(our_name)
    if m:
        idx, suffix = m.groups()
        prefix = f"bert.encoder.layer.{idx}"
        module, _, kind = suffix.rpartition(".")
        if module == "self_attention.linear_qkv":
            names = (f"{prefix}.attention.self.{p}.{kind}" for p in ("query", "key", "value"))
            return grouped_qkv(*names, s.heads)
        if module in _IN_LAYER:
            return [Segment(f"{prefix}.{_IN_LAYER[module]}.{kind}", 0, -1)]
        raise KeyError(our_name)
    if our_name == "embedding.weight" or (our_name == "output_layer.weight" and s.tie_embeddings):
        return vocab("bert.embeddings.word_embeddings.weight", s)
    if our_name == "output_layer.weight":
        return vocab("cls.predictions.decoder.weight", s)
    if our_name == "output_layer.bias":
        return vocab("cls.predictions.bias", s)
    if our_name in _OWN:
        return [Segment(_OWN[our_name], 0, -1)]
    raise KeyError(our_name)


__all__ = ["TIED_COPIES", "bert_segments"]
