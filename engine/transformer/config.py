"""TransformerConfig: everything a layer needs to build itself, derived once from a JobSpec.

The model and its layers read only this (never the JobSpec or the parallel sizes directly), so
the same layer code builds every layout: tensor/sequence parallelism enter through the layers'
parallel linears, not through branches in the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.jobspec import JobSpec
from engine.jobspec.layout import sequence_parallel_effective
from engine.jobspec.model import MLASpec
from engine.jobspec.t5 import T5Spec
from engine.transformer.moe.router import MoEConfig
from engine.transformer.rope import RopeScaling

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    padded_vocab_size: int
    seq_length: int
    normalization: str  # "LayerNorm" | "RMSNorm"
    activation: str  # "gelu" | "gelu_tanh" | "swiglu"
    position_embedding: str  # "learned_absolute" | "rope" | "relative" (T5's buckets)
    add_bias_linear: bool  # every linear but the output layer (GPT-2)
    tie_embeddings: bool
    add_qkv_bias: bool | None = None  # the fused QKV projection's; None: add_bias_linear
    qk_layernorm: bool = False  # per-head norm of q and k before RoPE (Qwen3)
    kv_channels: int | None = None  # head dim; None: hidden_size // num_attention_heads
    rope_scaling: RopeScaling | None = None
    mla: MLASpec | None = None  # multi-latent attention's sizes (model.attention: mla)
    mtp_num_layers: int = 0  # multi-token prediction depths (engine.transformer.mtp)
    mtp_loss_scaling_factor: float = 0.1
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    init_method_std: float = 0.02
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    recompute: str = "none"  # "none" | "selective" (attention core) | "full" (whole layers)
    fp8: bool = False  # the transformer layers' linears in float8 (engine.tensor_parallel.fp8)
    moe: MoEConfig | None = None
    # The tokenizer's (or config.json's) vocabulary; the embedding is padded beyond it to
    # padded_vocab_size, and the padded entries' logits are -inf (never predicted). None: no padding.
    vocab_size: int | None = None
    type_vocab_size: int = 0  # BERT's token types (segments); 0: none (decoders)
    causal: bool = True  # False: every token attends to every other (BERT's encoder)
    bert_binary_head: bool = False  # BERT's next-sentence head (pooler + 2-way classifier)
    t5: T5Spec | None = None  # model.arch t5's own sizes (engine/models/t5.py)

    @property
    def true_vocab_size(self) -> int:
        return self.vocab_size if self.vocab_size is not None else self.padded_vocab_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has an MoE feed-forward block."""
        return self.moe is not None and self.moe.layers[layer]

    @property
    def rotary_dim(self) -> int:
        """What RoPE rotates per head: the whole head, or MLA's decoupled RoPE part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear if self.add_qkv_bias is None else self.add_qkv_bias

    @property
    def output_layer_init_std(self) -> float:
        """Projections that write into the residual stream start smaller (GPT-2 / Megatron-Core)."""
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)

    @classmethod
    def from_job(cls, spec: JobSpec, vocab_size: int) -> TransformerConfig:
        m = spec.model
        vocab = m.vocab_size or vocab_size
        if vocab < vocab_size:
            raise ValueError(
                f"model.vocab_size ({vocab}) is smaller than the tokenizer's vocabulary ({vocab_size})"
            )
        multiple = m.make_vocab_size_divisible_by
        llama, t5 = m.arch == "llama", m.arch == "t5"
        return cls(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups,
            ffn_hidden_size=m.ffn_hidden_size,
            padded_vocab_size=multiple * math.ceil(vocab / multiple),
            seq_length=m.seq_length,
            normalization="RMSNorm" if llama or t5 else "LayerNorm",
            activation=m.activation,
            position_embedding="rope" if llama else "relative" if t5 else "learned_absolute",
            add_bias_linear=not (llama or t5),
            tie_embeddings=m.tie_embeddings,
            add_qkv_bias=m.qkv_bias,
            qk_layernorm=m.qk_layernorm,
            kv_channels=m.kv_channels,
            rope_scaling=RopeScaling(**m.rope_scaling.model_dump()) if m.rope_scaling else None,
            mla=m.mla,
            mtp_num_layers=m.mtp_num_layers,
            mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
            hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout,
            norm_epsilon=m.norm_epsilon,
            rotary_base=m.rotary_base,
            init_method_std=m.init_method_std,
            params_dtype=DTYPES[spec.training.precision],
            sequence_parallel=sequence_parallel_effective(spec.parallel),
            recompute=spec.training.recompute,
            fp8=spec.training.fp8,
            moe=_moe_config(spec),
            vocab_size=vocab,
            type_vocab_size=m.type_vocab_size or 0,
            causal=m.arch != "bert",
            bert_binary_head=bool(m.bert_binary_head),
            t5=m.t5,
        )


def _moe_config(spec: JobSpec) -> MoEConfig | None:
    m = spec.model.moe
    if m is None:
        return None
    n = spec.model.num_layers
    layers = (
        [bool(v) for v in m.layer_pattern] if m.layer_pattern else [i % m.layer_freq == 0 for i in range(n)]
    )
    return MoEConfig(
        num_experts=m.num_experts,
        top_k=m.top_k,
        ffn_hidden_size=m.ffn_hidden_size or spec.model.ffn_hidden_size,
        shared_expert_ffn_hidden_size=m.shared_expert_ffn_hidden_size,
        score=m.router_score,
        aux_loss_coeff=m.aux_loss_coeff,
        z_loss_coeff=m.z_loss_coeff,
        expert_bias=m.expert_bias,
        expert_bias_update_rate=m.expert_bias_update_rate,
        capacity_factor=m.capacity_factor,
        num_groups=m.num_groups,
        topk_group=m.topk_group,
        routed_scaling_factor=m.routed_scaling_factor,
        seq_aux_loss=m.load_balancing_type == "seq_aux_loss",
        norm_topk_prob=m.norm_topk_prob,
        layers=tuple(layers),
    )
