"""A job's `model` section -> the config.json of its Hugging Face family (`elastron export`).

The inverse of hf_fields.hf_model_fields for every field that function reads; which family a
model of given settings exports as is looked up in the registry (hf_families.py) by its traits.
"""

from __future__ import annotations

from typing import Any

from engine.jobspec.hf_families import FAMILIES, HFConfigError, HFFamily, family_with
from engine.jobspec.hf_fields import YARN_OPTIONAL
from engine.jobspec.hf_t5 import t5_hf_config


def _rope_parameters(model) -> dict[str, Any]:
    """config.json's rope_parameters (transformers 5) for the model's rotary base and scaling."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rotary_base}
    r = model.rope_scaling
    if r is None:
        return rope
    rope.update(rope_type=r.type, factor=r.factor)
    if r.type == "llama3":
        rope.update(
            low_freq_factor=r.low_freq_factor,
            high_freq_factor=r.high_freq_factor,
            original_max_position_embeddings=r.original_max_position_embeddings,
        )
    if r.type == "yarn":
        rope.update(
            original_max_position_embeddings=r.original_max_position_embeddings,
            beta_fast=r.beta_fast,
            beta_slow=r.beta_slow,
            truncate=r.truncate,
        )
        rope.update({k: getattr(r, k) for k in YARN_OPTIONAL if getattr(r, k) is not None})
    return rope


def hf_config_for(model: Any, base: dict[str, Any] | None = None, *, dtype: str = "bf16") -> dict[str, Any]:
    """config.json for a job's `model` section (a ModelSpec): over `base` (the config.json the
    job was imported from, so its token ids and other fields survive) when it is of the same
    family. The inverse of hf_model_fields for every field that function reads."""
    if model.arch == "t5":
        return t5_hf_config(model, family_with("t5"), base, dtype)
    fam = _family_of(model)
    cfg = dict(base or {})
    base_arch = (cfg.get("architectures") or [None])[0]
    base_fam = FAMILIES.get(base_arch)
    if base_fam is not None and base_fam.same_as == fam.architecture:  # e.g. Mistral: Llama's tensors
        fam = base_fam
    if base_arch != fam.architecture:
        cfg = {k: v for k, v in cfg.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for key in ("torch_dtype", "rope_scaling", "rope_theta", "rope_parameters"):
        cfg.pop(key, None)
    cfg.update(architectures=[fam.architecture], model_type=fam.model_type, vocab_size=model.vocab_size)
    cfg["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    if fam.layout == "deepseek":
        return _deepseek_config(model, cfg)
    if fam.layout == "bert":
        from engine.jobspec.hf_bert import bert_config

        return bert_config(model, cfg)
    if fam.layout == "gpt2":
        act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[model.activation]
        cfg.update(
            n_embd=model.hidden_size,
            n_layer=model.num_layers,
            n_head=model.num_attention_heads,
            n_inner=model.ffn_hidden_size,
            n_positions=model.seq_length,
            layer_norm_epsilon=model.norm_epsilon,
            activation_function=act,
            tie_word_embeddings=True,
        )
        return cfg
    cfg.update(
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        head_dim=model.head_dim,
        hidden_act="silu",
        rms_norm_eps=model.norm_epsilon,
        tie_word_embeddings=model.tie_embeddings,
        max_position_embeddings=max(int(cfg.get("max_position_embeddings") or 0), model.seq_length),
    )
    cfg.update(fam.export_flags)
    cfg["rope_parameters"] = _rope_parameters(model)
    moe = model.moe
    if fam.moe == "mixtral":
        cfg.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k)
    elif fam.moe == "qwen3_moe":
        pattern = moe.layer_pattern or [1] * model.num_layers
        cfg.update(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            norm_topk_prob=bool(moe.norm_topk_prob),
            moe_intermediate_size=moe.ffn_hidden_size or model.ffn_hidden_size,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, v in enumerate(pattern) if not v],
        )
    return cfg


def _family_of(model: Any) -> HFFamily:
    """The Hugging Face family that holds a model of these settings, or HFConfigError naming the
    setting no family has."""
    if model.arch == "bert":  # the job spec admits only what the BERT families have
        return family_with("bert", binary_head=bool(model.bert_binary_head))
    if model.attention == "mla":
        m = model.moe
        if m is not None and (
            m.router_score != "sigmoid"
            or (m.shared_expert_ffn_hidden_size or 0) % (m.ffn_hidden_size or model.ffn_hidden_size)
        ):
            raise HFConfigError(
                "an MLA model exports as DeepSeek-V3, whose router scores are sigmoid and whose shared experts "
                "are whole multiples of the expert width"
            )
        return family_with("deepseek", moe="deepseek")
    if model.arch == "gpt2":
        if (
            model.qk_layernorm
            or model.moe is not None
            or not model.qkv_bias
            or model.activation not in ("gelu", "gelu_tanh")
        ):
            raise HFConfigError(
                "a gpt2 model with qk_layernorm, MoE, no qkv bias or a swiglu activation has no Hugging Face family"
            )
        return family_with("gpt2")
    if model.activation != "swiglu":
        raise HFConfigError(f"model.activation={model.activation!r}: the Llama-style families use swiglu")
    if model.moe is not None:
        m = model.moe
        if m.router_score != "softmax" or m.shared_expert_ffn_hidden_size or m.expert_bias:
            raise HFConfigError(
                "an MoE model with a sigmoid router, a shared expert or expert bias has no Hugging Face family here "
                "(Mixtral and Qwen3-MoE route with softmax, without either)"
            )
        if model.qk_layernorm:
            return family_with("llama", qk_layernorm=True, moe="qwen3_moe")
        if (
            model.qkv_bias
            or not m.norm_topk_prob
            or m.layer_pattern
            or m.layer_freq != 1
            or m.ffn_hidden_size not in (None, model.ffn_hidden_size)
        ):
            raise HFConfigError(
                "an MoE model without qk_layernorm exports as Mixtral, which needs model.moe.norm_topk_prob: true, "
                "every layer MoE with the model's ffn_hidden_size, and no qkv_bias"
            )
        return family_with("llama", moe="mixtral")
    if model.qk_layernorm:
        if model.qkv_bias:
            raise HFConfigError(
                "qkv_bias with qk_layernorm has no Hugging Face family (Qwen3 has neither bias)"
            )
        return family_with("llama", qk_layernorm=True)
    return family_with("llama", qkv_bias=model.qkv_bias)


def _deepseek_config(model: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    mla, moe, n = model.mla, model.moe, model.num_layers
    pattern = (moe.layer_pattern or [int(i % moe.layer_freq == 0) for i in range(n)]) if moe else [0] * n
    dense = pattern.index(1) if 1 in pattern else n
    if any(not v for v in pattern[dense:]):
        raise HFConfigError(
            "DeepSeek-V3 has dense layers first and MoE layers after: model.moe.layer_pattern must be 0s then 1s"
        )
    width = (moe.ffn_hidden_size or model.ffn_hidden_size) if moe else model.ffn_hidden_size
    cfg.update(
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        moe_intermediate_size=width,
        num_hidden_layers=n,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_attention_heads,
        n_routed_experts=moe.num_experts if moe else 1,
        num_experts_per_tok=moe.top_k if moe else 1,
        n_shared_experts=((moe.shared_expert_ffn_hidden_size or 0) // width) if moe else 0,
        n_group=(moe.num_groups or 1) if moe else 1,
        topk_group=(moe.topk_group or 1) if moe else 1,
        routed_scaling_factor=moe.routed_scaling_factor if moe else 1.0,
        norm_topk_prob=(moe.norm_topk_prob if moe.norm_topk_prob is not None else moe.top_k > 1)
        if moe
        else True,
        first_k_dense_replace=dense,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        head_dim=mla.qk_rope_head_dim,
        hidden_act="silu",
        attention_bias=False,
        rms_norm_eps=model.norm_epsilon,
        tie_word_embeddings=model.tie_embeddings,
        max_position_embeddings=max(int(cfg.get("max_position_embeddings") or 0), model.seq_length),
        rope_interleave=cfg.get("rope_interleave", True),
        rope_parameters=_rope_parameters(model),
        # the MTP depths, written as the layers after the last (DeepSeek's layout)
        num_nextn_predict_layers=model.mtp_num_layers,
    )
    return cfg
