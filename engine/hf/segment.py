"""The pieces every family's tensor table is made of (engine/hf/families.py, bert_tensors.py,
t5.py): a `Segment` (a row range of one Hugging Face tensor), what the tables need of the model
(`Shapes`, `Heads`), and the segment lists the families share: a whole tensor, a vocabulary
with its padding rows, and Megatron-Core's grouped QKV read from separate q / k / v rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Segment:
    """`length` rows of our tensor: rows `start:start+length` of HF tensor `name` (its columns
    when `transposed`), or zeros when `name` is None (vocabulary padding)."""

    name: str | None
    start: int
    length: int
    transposed: bool = False
    order: tuple[int, ...] | None = None  # our row i is the HF row start + order[i]


@dataclass(frozen=True)
class Heads:
    num_attention_heads: int
    num_query_groups: int
    head_dim: int

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


@dataclass(frozen=True)
class Shapes:
    """What the mapping needs of the model: head layout, widths, true and padded vocabulary."""

    heads: Heads
    hidden_size: int
    ffn_hidden_size: int
    expert_ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_embeddings: bool
    shared_expert_ffn_hidden_size: int | None = None
    mla: Any = None  # the MLASpec of an MLA model
    rope_interleave: bool = True  # DeepSeek checkpoints: RoPE dimensions interleaved
    num_layers: int = 0  # DeepSeek's MTP depths are stored as the layers after these

    @classmethod
    def of(cls, config: Any) -> Shapes:
        """From a TransformerConfig (or anything with its field names)."""
        moe = getattr(config, "moe", None)
        return cls(
            heads=Heads(config.num_attention_heads, config.num_query_groups, config.head_dim),
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.ffn_hidden_size,
            expert_ffn_hidden_size=moe.ffn_hidden_size if moe is not None else config.ffn_hidden_size,
            vocab_size=config.vocab_size,
            padded_vocab_size=config.padded_vocab_size,
            tie_embeddings=config.tie_embeddings,
            shared_expert_ffn_hidden_size=moe.shared_expert_ffn_hidden_size if moe is not None else None,
            mla=getattr(config, "mla", None),
            num_layers=config.num_layers,
        )


def whole(name: str, rows: int) -> list[Segment]:
    """All `rows` rows of HF tensor `name`."""
    return [Segment(name, 0, rows)]


def vocab(name: str, s: Shapes) -> list[Segment]:
    """A vocabulary-sized HF tensor `name`, then zero rows up to the padded vocabulary."""
    pad = s.padded_vocab_size - s.vocab_size
    return [Segment(name, 0, s.vocab_size)] + ([Segment(None, 0, pad)] if pad else [])


def grouped_qkv(q: str, k: str, v: str, h: Heads) -> list[Segment]:
    """Megatron-Core's fused QKV (per query group its queries, its key, its value) from HF's
    separate q / k / v projections."""
    d, qg = h.head_dim, h.q_per_group
    out = []
    for g in range(h.num_query_groups):
        out += [Segment(q, g * qg * d, qg * d), Segment(k, g * d, d), Segment(v, g * d, d)]
    return out
