"""`model`: the architecture, with Megatron-Core's names (and its MoE feed-forward layers).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from engine.jobspec.common import PositiveInt, _divisors, _Section
from engine.jobspec.lora import LoRASpec
from engine.jobspec.t5 import T5Spec, check_t5_model

# Validation context key: why resolve_hf_config could not merge model.init_from's config.json
# (parse_job passes it, so the message stands where the read would have failed, among the
# other sections' problems).
HF_CONFIG_ERROR = "hf_config_error"


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
    norm_topk_prob: bool | None = Field(
        None,
        description="Divide the k chosen gate weights by their sum (Mixtral, Qwen3-MoE); the aux loss still "
        "uses the unnormalised scores. Default: no for softmax scores, yes for sigmoid (top_k > 1).",
    )

    num_groups: PositiveInt | None = Field(
        None,
        description="Group-limited routing (DeepSeek-V3): experts form this many equal groups; a token "
        "picks its top_k only among the topk_group groups with the highest sum of their 2 best scores.",
    )
    topk_group: PositiveInt | None = Field(None, description="Groups a token may route to (with num_groups).")
    routed_scaling_factor: float = Field(
        1.0, gt=0.0, description="The routed experts' gate weights are multiplied by this (DeepSeek-V3: 2.5)."
    )
    load_balancing_type: Literal["aux_loss", "seq_aux_loss"] = Field(
        "aux_loss",
        description="aux_loss: the balancing loss over each micro-batch's tokens; seq_aux_loss: over each "
        "sequence, averaged (DeepSeek-V3's complementary sequence-wise loss). Weight: aux_loss_coeff.",
    )

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k ({self.top_k}) is larger than model.moe.num_experts ({self.num_experts})"
            )
        if (self.num_groups is None) != (self.topk_group is None):
            raise ValueError("model.moe.num_groups and model.moe.topk_group go together: set both or neither")
        if self.num_groups is not None:
            if self.num_experts % self.num_groups:
                raise ValueError(
                    f"model.moe.num_groups ({self.num_groups}) must divide model.moe.num_experts ({self.num_experts})"
                )
            per_group = self.num_experts // self.num_groups
            if per_group < 2:
                raise ValueError(
                    "model.moe.num_groups: each group needs at least 2 experts (a group's score is its 2 best)"
                )
            if self.topk_group > self.num_groups:
                raise ValueError(
                    f"model.moe.topk_group ({self.topk_group}) is larger than model.moe.num_groups ({self.num_groups})"
                )
            if self.top_k > self.topk_group * per_group:
                raise ValueError(
                    f"model.moe.top_k ({self.top_k}) exceeds the experts of model.moe.topk_group groups "
                    f"({self.topk_group} x {per_group})"
                )
        return self


class RopeScalingSpec(_Section):
    """RoPE frequency scaling for contexts longer than pretraining, as transformers computes it
    (its `rope_scaling` / `rope_parameters`): `linear` divides every inverse frequency by
    `factor`; `llama3` (Llama 3.1) divides only the low frequencies, smoothly between the two
    wavelength bounds that `low_freq_factor` and `high_freq_factor` set; `yarn` (DeepSeek-V3,
    Qwen long context) interpolates the slow dimensions, keeps the fast ones, ramps between
    `beta_slow` and `beta_fast` rotations, and scales attention."""

    type: Literal["llama3", "linear", "yarn"] = Field(description="transformers' rope_type.")
    factor: float = Field(gt=0.0, description="How much longer the context is than at pretraining.")
    low_freq_factor: float = Field(
        1.0, gt=0.0, description="llama3: wavelengths above original/low_freq_factor are divided by factor."
    )
    high_freq_factor: float = Field(
        4.0, gt=0.0, description="llama3: wavelengths below original/high_freq_factor are kept."
    )
    original_max_position_embeddings: PositiveInt = Field(
        8192, description="llama3 and yarn: the context length the model was pretrained on."
    )
    beta_fast: float = Field(32.0, gt=0.0, description="yarn: dimensions turning more often than this keep their frequency.")
    beta_slow: float = Field(1.0, gt=0.0, description="yarn: dimensions turning less often than this are interpolated.")
    mscale: float | None = Field(None, description="yarn: attention factor numerator's mscale (with mscale_all_dim).")
    mscale_all_dim: float | None = Field(
        None, description="yarn: attention factor denominator's mscale; MLA also scales its softmax by it."
    )
    attention_factor: float | None = Field(None, gt=0.0, description="yarn: cos/sin scale (default from factor).")
    truncate: bool = Field(True, description="yarn: round the ramp's bounds to whole dimensions.")

    @model_validator(mode="after")
    def _check(self) -> RopeScalingSpec:
        owners = {
            "low_freq_factor": ("llama3",),
            "high_freq_factor": ("llama3",),
            "original_max_position_embeddings": ("llama3", "yarn"),
            **{k: ("yarn",) for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")},
        }
        for name in sorted(self.model_fields_set & owners.keys()):
            # A dumped spec carries every field at its default: only a value that says something counts.
            if self.type not in owners[name] and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(
                    f"model.rope_scaling.{name} applies to type {' and '.join(owners[name])} only: remove it for "
                    f"type {self.type}"
                )
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"model.rope_scaling.high_freq_factor ({self.high_freq_factor}) must be larger than "
                f"model.rope_scaling.low_freq_factor ({self.low_freq_factor})"
            )
        if self.type == "yarn" and self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"model.rope_scaling.beta_fast ({self.beta_fast}) must be larger than "
                f"model.rope_scaling.beta_slow ({self.beta_slow})"
            )
        return self


class MLASpec(_Section):
    """Multi-latent attention's sizes (DeepSeek-V2/V3; Megatron-Core's names)."""

    q_lora_rank: PositiveInt | None = Field(
        None, description="Rank of the query latent; none: queries are one projection (DeepSeek-V2-Lite)."
    )
    kv_lora_rank: PositiveInt = Field(description="Rank of the key/value latent.")
    qk_nope_head_dim: PositiveInt = Field(description="Per head, the query/key part without RoPE.")
    qk_rope_head_dim: PositiveInt = Field(
        description="Per head, the query part with RoPE; the RoPE key part is one, shared by all heads."
    )
    v_head_dim: PositiveInt = Field(description="Per head, the value size.")

    @model_validator(mode="after")
    def _check(self) -> MLASpec:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.mla.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")
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
    hf_config_digest: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        exclude_if=lambda v: v is None,  # a spec without init_from dumps as it always did
        description="Set where the job is submitted: the sha256 of model.init_from's config.json, whose "
        "fields are then merged into this section (later validations read nothing).",
    )
    arch: Literal["gpt2", "llama", "bert", "t5"] = "llama"
    num_layers: PositiveInt = 2
    hidden_size: PositiveInt = 64
    num_attention_heads: PositiveInt = 4
    num_query_groups: PositiveInt | None = Field(
        None, description="Grouped-query attention groups; default: one per head (plain multi-head)."
    )
    kv_channels: PositiveInt | None = Field(
        None,
        description="Head dimension (Megatron-Core's name); default hidden_size / num_attention_heads. "
        "When set, heads x kv_channels need not equal hidden_size (Qwen3).",
    )
    ffn_hidden_size: PositiveInt | None = Field(
        None, description="Default: 8/3*hidden rounded up to 64 with swiglu, else 4*hidden."
    )
    activation: Literal["gelu", "gelu_tanh", "swiglu"] | None = Field(
        None,
        description="Feed-forward activation (dense MLP and experts): gelu (exact erf), gelu_tanh (GPT-2's "
        "gelu_new) or swiglu. Default: gelu for gpt2, swiglu for llama.",
    )
    qkv_bias: bool | None = Field(
        None,
        description="Bias on the fused QKV projection only (Qwen2). Default: the arch's (gpt2: biases on "
        "every linear; llama: none).",
    )
    qk_layernorm: bool = Field(
        False,
        description="Normalise each head's queries and keys over the head dimension before RoPE (Qwen3), "
        "with the model's norm; one weight of size kv_channels each for q and k, shared by the heads.",
    )
    vocab_size: PositiveInt | None = Field(None, description="Default: the tokenizer's vocabulary size.")
    make_vocab_size_divisible_by: PositiveInt = Field(
        128,
        description="Pad the embedding table to a multiple of this (must be divisible by parallel.tensor).",
    )
    seq_length: PositiveInt = 128
    tie_embeddings: bool | None = Field(None, description="Default: true for gpt2, bert and t5, false for llama.")
    type_vocab_size: PositiveInt | None = Field(
        None,
        exclude_if=lambda v: v is None,  # a decoder's spec dumps as it always did
        description="arch bert: token types (segments A/B) the embedding learns; default 2 (BERT's).",
    )
    bert_binary_head: bool | None = Field(
        None,
        exclude_if=lambda v: v is None,
        description="arch bert: the next-sentence head (a pooler on [CLS] and a 2-way classifier, as "
        "transformers' BERT pretraining model); its loss, the mean over the batch's sequences, is added to the masked-LM loss "
        "(data.mlm.next_sentence gives its labels). Default: false.",
    )
    hidden_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    norm_epsilon: float = Field(1e-5, gt=0.0)
    rotary_base: float = Field(10000.0, gt=0.0)
    attention: Literal["standard", "mla"] = Field(
        "standard",
        description="standard: (grouped-query) self-attention; mla: multi-latent attention (model.mla).",
    )
    mla: MLASpec | None = Field(None, description="Multi-latent attention's sizes (with attention: mla).")
    mtp_num_layers: Annotated[int, Field(ge=0, le=8, strict=True)] = Field(
        0,
        description="Multi-token prediction depths after the decoder (DeepSeek-V3: 1): depth k also predicts "
        "the token k+1 places further, sharing the embedding and output layer.",
    )
    mtp_loss_scaling_factor: float = Field(
        0.1, ge=0.0, description="Weight of the mean of the depths' losses in the objective (DeepSeek-V3: 0.1-0.3)."
    )
    rope_scaling: RopeScalingSpec | None = Field(
        None, description="Scale RoPE frequencies for long contexts (llama arch only); default: none."
    )
    init_method_std: float = Field(0.02, gt=0.0)
    moe: MoESpec | None = Field(None, description="Mixture of Experts feed-forward layers; default: dense.")
    t5: T5Spec | None = Field(
        None,
        exclude_if=lambda v: v is None,  # only a T5 model has (and dumps) it
        description="model.arch t5: the encoder-decoder's own sizes (engine/jobspec/t5.py); filled by default.",
    )
    lora: LoRASpec | None = Field(
        None,
        exclude_if=lambda v: v is None,  # a spec without adapters dumps as it always did
        description="Train low-rank adapters (LoRA, PEFT's format) on the layers' projections instead of "
        "every weight; the base weights are frozen. Default: full fine-tuning.",
    )

    @model_validator(mode="before")
    @classmethod
    def _hf_fields_merged(cls, data: Any, info: ValidationInfo) -> Any:
        """model.init_from: the architecture fields are config.json's, merged by
        engine.jobspec.hf_config.resolve_hf_config (which sets hf_config_digest) before
        validation, so the rest of validation (and the layout rules of the whole job) sees the
        real model without this validator reading anything."""
        if not isinstance(data, dict):
            return data
        if data.get("init_from") and not data.get("hf_config_digest"):
            failed = (info.context or {}).get(HF_CONFIG_ERROR)
            raise ValueError(
                str(failed)
                if failed is not None
                else f"model.init_from: the fields of {data['init_from']}/config.json are not merged into "
                "this section (validation reads no files): parse the job with engine.jobspec.parse_job, "
                "or run engine.jobspec.resolve_hf_config on it first"
            )
        if data.get("hf_config_digest") and not data.get("init_from"):
            raise ValueError(
                "model.hf_config_digest is the digest of model.init_from's config.json: remove it, or set "
                "model.init_from"
            )
        return data

    @model_validator(mode="after")
    def _arch_defaults(self) -> ModelSpec:
        if self.arch == "bert":  # the encoder's defaults, before the ones that depend on them
            from engine.jobspec.bert import bert_defaults

            bert_defaults(self)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.activation is None:
            self.activation = {"gpt2": "gelu", "t5": "gelu_tanh"}.get(self.arch, "swiglu")
        if self.qkv_bias is None:
            self.qkv_bias = self.arch == "gpt2"
        if self.ffn_hidden_size is None:
            if self.activation == "swiglu":
                self.ffn_hidden_size = 64 * math.ceil(8 * self.hidden_size / 3 / 64)
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.tie_embeddings is None:
            self.tie_embeddings = self.arch in ("gpt2", "bert", "t5")
        if self.arch == "bert":
            from engine.jobspec.bert import check_bert_model  # the encoder's own rules

            check_bert_model(self)
        else:
            for name in ("type_vocab_size", "bert_binary_head"):
                if getattr(self, name) is not None:
                    raise ValueError(f"model.{name} applies to arch bert only: remove it for arch {self.arch}")
        if self.arch == "t5":
            self.t5 = (self.t5 or T5Spec()).filled(self.num_layers, self.tie_embeddings)
        check_t5_model(self)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_attention_heads "
                f"({self.num_attention_heads}): pick heads from {_divisors(self.hidden_size)}, "
                "or set model.kv_channels (the head size)"
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
        if self.arch == "llama" and self.head_dim % 2:
            what = (
                "model.kv_channels (the head size)"
                if self.kv_channels is not None
                else "model.hidden_size / model.num_attention_heads (the head size)"
            )
            raise ValueError(f"{what} must be even for rotary embeddings (llama), got {self.head_dim}")
        if (self.attention == "mla") != (self.mla is not None):
            raise ValueError(
                "model.attention: mla needs model.mla (its sizes), and model.mla needs model.attention: mla"
            )
        if self.attention == "mla" and (self.arch != "llama" or self.qk_layernorm or self.qkv_bias):
            raise ValueError(
                "model.attention: mla is built for arch llama (RMSNorm, RoPE) without qk_layernorm or qkv_bias"
            )
        if self.mtp_num_layers and self.arch != "llama":
            raise ValueError("model.mtp_num_layers is built for arch llama (RoPE): use arch llama or 0")
        if self.lora is not None:
            self._check_lora(self.lora)
        if self.arch == "gpt2" and self.rope_scaling is not None:
            raise ValueError(
                "model.rope_scaling scales rotary embeddings, but arch gpt2 learns its positions: "
                "remove model.rope_scaling or use arch llama"
            )
        return self

    def _check_lora(self, lora: LoRASpec) -> None:
        """What the adapters cannot sit on (yet), each with the fix."""
        if self.moe is not None:
            raise ValueError(
                "model.lora: LoRA on Mixture-of-Experts models is not supported (experts get no adapters): "
                "remove model.lora or model.moe"
            )
        if self.attention == "mla":
            raise ValueError("model.lora: LoRA with model.attention: mla is not supported yet: use standard attention")
        if self.mtp_num_layers:
            raise ValueError("model.lora: LoRA with model.mtp_num_layers is not supported yet: set it to 0")
        if "gate_proj" in lora.target_modules and self.activation != "swiglu":
            raise ValueError(
                f"model.lora.target_modules: gate_proj needs a gated MLP (activation swiglu), this model's is "
                f"{self.activation}: use up_proj or linear_fc1"
            )

    @property
    def head_dim(self) -> int:
        """The effective head size: kv_channels, else hidden_size / num_attention_heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads
