"""`model`: the architecture, with Megatron-Core's names (and its MoE feed-forward layers).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from engine.jobspec.common import PositiveInt, _divisors, _Section
from engine.jobspec.hf_config import check_sliding_window, hf_model_fields, merge_fields, read_hf_config


class MoESpec(_Section):
    """Mixture of Experts in the decoder's feed-forward blocks (Megatron-Core's names)."""

    num_experts: PositiveInt
    top_k: PositiveInt = 2
    layer_freq: PositiveInt = Field(1, description="Every N-th layer is MoE (1: all), counting from layer 0.")
    layer_pattern: list[Annotated[int, Field(ge=0, le=1, strict=True)]] | None = Field(
        None, description="One 0/1 per layer (1: MoE); overrides layer_freq."
    )
    ffn_hidden_size: PositiveInt | None = Field(
        None, description="Per expert; default: model.ffn_hidden_size."
    )
    shared_expert_ffn_hidden_size: PositiveInt | None = Field(
        None, description="A dense expert every token also goes through; default: none."
    )
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    aux_loss_coeff: float = Field(1e-2, ge=0.0, description="Load-balancing loss weight, per micro-batch.")
    z_loss_coeff: float = Field(0.0, ge=0.0, description="Router z-loss weight.")
    expert_bias: bool = Field(False, description="Aux-loss-free balancing: a per-expert bias on the pick.")
    expert_bias_update_rate: float = Field(1e-3, gt=0.0)
    capacity_factor: float | None = Field(
        None, gt=0.0, description="Tokens per expert at most capacity_factor x the even share; extra dropped."
    )

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k ({self.top_k}) is larger than model.moe.num_experts ({self.num_experts})"
            )
        return self


class ModelSpec(_Section):
    """Architecture, with Megatron-Core's names. `arch` picks the family defaults."""

    init_from: str | None = Field(
        None,
        description="A Hugging Face model folder (local, or s3://bucket/prefix): config.json and "
        "model.safetensors (or shards with model.safetensors.index.json). The architecture fields come "
        "from its config.json (a field set here to another value is an error naming both); the "
        "weights are loaded before the first step unless the job resumes from a checkpoint.",
    )
    arch: Literal["gpt2", "llama"] = "llama"
    num_layers: PositiveInt = 2
    hidden_size: PositiveInt = 64
    num_attention_heads: PositiveInt = 4
    num_query_groups: PositiveInt | None = Field(
        None, description="Grouped-query attention groups; default: one per head (plain multi-head)."
    )
    ffn_hidden_size: PositiveInt | None = Field(
        None, description="Default: 4*hidden (gpt2), or 8/3*hidden rounded up to 64 (llama, SwiGLU)."
    )
    vocab_size: PositiveInt | None = Field(None, description="Default: the tokenizer's vocabulary size.")
    make_vocab_size_divisible_by: PositiveInt = Field(
        128,
        description="Pad the embedding table to a multiple of this (must be divisible by parallel.tensor).",
    )
    seq_length: PositiveInt = 128
    tie_embeddings: bool | None = Field(None, description="Default: true for gpt2, false for llama.")
    hidden_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    norm_epsilon: float = Field(1e-5, gt=0.0)
    rotary_base: float = Field(10000.0, gt=0.0)
    init_method_std: float = Field(0.02, gt=0.0)
    moe: MoESpec | None = Field(None, description="Mixture of Experts feed-forward layers; default: dense.")

    @model_validator(mode="before")
    @classmethod
    def _from_hf_config(cls, data: Any) -> Any:
        """model.init_from: the architecture fields are config.json's, so the rest of validation
        (and the layout rules of the whole job) sees the real model."""
        if not isinstance(data, dict) or not data.get("init_from"):
            return data
        if not isinstance(data["init_from"], str):
            raise ValueError("model.init_from must be a path or an s3:// URI to a Hugging Face model folder")
        cfg = read_hf_config(data["init_from"])
        check_sliding_window(cfg, data.get("seq_length", cls.model_fields["seq_length"].default))
        return merge_fields(hf_model_fields(cfg), data)

    @model_validator(mode="after")
    def _arch_defaults(self) -> ModelSpec:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.arch == "gpt2":
                self.ffn_hidden_size = 4 * self.hidden_size
            else:
                self.ffn_hidden_size = 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        if self.tie_embeddings is None:
            self.tie_embeddings = self.arch == "gpt2"
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_attention_heads "
                f"({self.num_attention_heads}): pick heads from {_divisors(self.hidden_size)}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups ({self.num_query_groups}) must divide model.num_attention_heads "
                f"({self.num_attention_heads}): pick one of {_divisors(self.num_attention_heads)}"
            )
        if (
            self.moe is not None
            and self.moe.layer_pattern is not None
            and len(self.moe.layer_pattern) != self.num_layers
        ):
            raise ValueError(
                f"model.moe.layer_pattern has {len(self.moe.layer_pattern)} entries for model.num_layers "
                f"({self.num_layers}): give one 0/1 per layer"
            )
        if self.arch == "llama" and (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                "model.hidden_size / model.num_attention_heads (the head size) must be even for rotary "
                f"embeddings (llama), got {self.hidden_size // self.num_attention_heads}"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
