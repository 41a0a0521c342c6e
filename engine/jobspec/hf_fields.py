"""config.json -> the `model` fields it fixes, and their merge into a job's `model` section.

Pure functions of a parsed config.json (reading it is hf_config.py's job): the API, `elastron
train` and the exporter's round-trip tests see the same architecture. Which family a config is,
and what differs between families, is the registry's (hf_families.py).
"""

from __future__ import annotations

from typing import Any

from engine.jobspec.hf_families import FAMILIES, HFConfigError, HFFamily
from engine.jobspec.hf_t5 import t5_fields

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

# yarn's parameters without a default value: in config.json only when they have one.
YARN_OPTIONAL = ("mscale", "mscale_all_dim", "attention_factor")


def _rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """rotary_base and rope_scaling. transformers 5 keeps both in `rope_parameters`; 4.x in
    `rope_theta` and `rope_scaling`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        out["rope_scaling"] = {
            "type": "llama3",
            "factor": float(params["factor"]),
            "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(params.get("original_max_position_embeddings", 8192)),
        }
    elif kind == "linear":
        out["rope_scaling"] = {"type": "linear", "factor": float(params["factor"])}
    elif kind == "yarn":
        for needed in ("factor", "original_max_position_embeddings"):
            if params.get(needed) is None:
                raise HFConfigError(f"config.json rope_scaling (yarn) has no {needed}: it is needed to import it")
        scaling = {
            "type": "yarn",
            "factor": float(params["factor"]),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
            # transformers' defaults where the file leaves them out
            "beta_fast": float(params.get("beta_fast") or 32.0),
            "beta_slow": float(params.get("beta_slow") or 1.0),
            "truncate": bool(params.get("truncate", True)),
        }
        for key in YARN_OPTIONAL:
            if params.get(key) is not None:
                scaling[key] = float(params[key])
        out["rope_scaling"] = scaling
    elif kind not in ("default", None):
        raise HFConfigError(
            f"config.json rope_type={kind!r} is not supported (default, llama3, linear and yarn are)"
        )
    return out




def hf_model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `model` fields config.json fixes, or HFConfigError naming the unsupported field."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in FAMILIES:
        raise HFConfigError(
            f"config.json architectures={archs!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    fam = FAMILIES[arch]
    if fam.layout == "t5":
        return t5_fields(cfg, fam)
    if fam.layout == "gpt2":
        return _gpt2_fields(cfg, fam)
    if fam.layout == "deepseek":
        return _deepseek_fields(cfg, fam)
    if fam.layout == "bert":
        from engine.jobspec.hf_bert import bert_fields

        return bert_fields(cfg, fam)
    return _llama_style_fields(cfg, fam)


def _deepseek_fields(cfg: dict[str, Any], fam: HFFamily) -> dict[str, Any]:
    """DeepSeek-V3: multi-latent attention, dense first `first_k_dense_replace` layers, then MoE
    layers routed by sigmoid scores with a correction bias, in groups, with shared experts."""
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise HFConfigError(f"config.json {flag}=true is not supported for {fam.architecture}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"config.json hidden_act={cfg.get('hidden_act')!r} is not supported (only silu)")
    heads, n = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    fields: dict[str, Any] = {
        "arch": fam.arch,
        "num_layers": n,
        "hidden_size": int(cfg["hidden_size"]),
        "num_attention_heads": heads,
        "num_query_groups": heads,
        "ffn_hidden_size": int(cfg["intermediate_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "qkv_bias": False,
        "qk_layernorm": False,
        "attention": "mla",
        "mla": {
            "q_lora_rank": int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
            "kv_lora_rank": int(cfg["kv_lora_rank"]),
            "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]),
            "qk_rope_head_dim": int(cfg["qk_rope_head_dim"]),
            "v_head_dim": int(cfg["v_head_dim"]),
        },
        **_rope_fields(cfg),
    }
    dense = int(cfg.get("first_k_dense_replace") or 0)
    experts = int(cfg.get("n_routed_experts") or 0)
    if experts and dense < n:
        groups = int(cfg.get("n_group") or 1)
        shared = int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"])
        fields["moe"] = {
            "num_experts": experts,
            "top_k": int(cfg["num_experts_per_tok"]),
            "router_score": "sigmoid",
            "expert_bias": True,  # e_score_correction_bias
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "ffn_hidden_size": int(cfg["moe_intermediate_size"]),
            **({"num_groups": groups, "topk_group": int(cfg["topk_group"])} if groups > 1 else {}),
            **({"shared_expert_ffn_hidden_size": shared} if shared else {}),
            **({"layer_pattern": [int(i >= dense) for i in range(n)]} if dense else {}),
        }
    return fields


def _llama_style_fields(cfg: dict[str, Any], fam: HFFamily) -> dict[str, Any]:
    arch = fam.architecture
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"config.json hidden_act={act!r} is not supported for {arch} (only silu)")
    if cfg.get("mlp_bias"):
        raise HFConfigError(f"config.json mlp_bias=true is not supported for {arch}")
    if cfg.get("attention_bias"):
        raise HFConfigError(
            f"config.json attention_bias=true is not supported for {arch} (it biases o_proj too; "
            "model.qkv_bias covers q, k and v only)"
        )
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    fields: dict[str, Any] = {
        "arch": fam.arch,
        "num_layers": int(cfg["num_hidden_layers"]),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": int(cfg.get("num_key_value_heads") or heads),
        "ffn_hidden_size": int(cfg["intermediate_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "qkv_bias": fam.qkv_bias,
        "qk_layernorm": fam.qk_layernorm,
        **_rope_fields(cfg),
    }
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        fields["kv_channels"] = int(head_dim)
    if fam.moe == "mixtral":
        fields["moe"] = {
            "num_experts": int(cfg["num_local_experts"]),
            "top_k": int(cfg["num_experts_per_tok"]),
            "norm_topk_prob": True,  # Mixtral: softmax over the k picked experts' logits
        }
    elif fam.moe == "qwen3_moe":
        n, step, dense = (
            int(cfg["num_hidden_layers"]),
            int(cfg.get("decoder_sparse_step") or 1),
            set(cfg.get("mlp_only_layers") or []),
        )
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(n)]
        fields["moe"] = {
            # transformers 5 writes num_local_experts for every MoE family; 4.x num_experts here.
            "num_experts": int(cfg.get("num_experts") or cfg["num_local_experts"]),
            "top_k": int(cfg["num_experts_per_tok"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "ffn_hidden_size": int(cfg["moe_intermediate_size"]),
            **({"layer_pattern": pattern} if not all(pattern) else {}),
        }
    return fields


def _gpt2_fields(cfg: dict[str, Any], fam: HFFamily) -> dict[str, Any]:
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise HFConfigError(f"config.json activation_function={act!r} is not supported for {fam.architecture}")
    for flag, ok in (
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("scale_attn_weights", True),
    ):
        if bool(cfg.get(flag, ok)) != ok:
            raise HFConfigError(f"config.json {flag}={cfg.get(flag)!r} is not supported for {fam.architecture}")
    hidden = int(cfg["n_embd"])
    return {
        "arch": fam.arch,
        "num_layers": int(cfg["n_layer"]),
        "hidden_size": hidden,
        "num_attention_heads": int(cfg["n_head"]),
        "num_query_groups": int(cfg["n_head"]),
        "ffn_hidden_size": int(cfg.get("n_inner") or 4 * hidden),
        "vocab_size": int(cfg["vocab_size"]),
        "tie_embeddings": True,
        "norm_epsilon": float(cfg.get("layer_norm_epsilon", 1e-5)),
        "activation": _GPT2_ACTIVATIONS[act],
        "qkv_bias": True,
    }


def check_sliding_window(cfg: dict[str, Any], seq_length: int) -> None:
    """The sequence fits what the model attends over: a sliding window (Mistral, Mixtral; Qwen
    only with use_sliding_window) must cover it, since we run full causal attention, and GPT-2's
    learned positions must reach it."""
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    if window is not None and int(window) < seq_length:
        raise HFConfigError(
            f"config.json sliding_window={window} is smaller than model.seq_length={seq_length}: "
            f"set model.seq_length <= {window} (sliding-window attention is not supported)"
        )
    if cfg.get("model_type") == "bert":  # learned positions too
        from engine.jobspec.hf_bert import check_bert_positions

        check_bert_positions(cfg, seq_length)
    positions = cfg.get("n_positions")
    if positions is not None and int(positions) < seq_length:
        raise HFConfigError(
            f"config.json n_positions={positions} is smaller than model.seq_length={seq_length}: "
            f"set model.seq_length <= {positions} (GPT-2 has that many learned positions)"
        )


def merge_fields(
    hf_fields: dict[str, Any], job_fields: dict[str, Any], where: str = "model"
) -> dict[str, Any]:
    """The job's `model` section with config.json's fields; a field set to another value fails
    naming both values. Sections (model.moe, model.rope_scaling) merge field by field."""
    out = dict(job_fields)
    for key, value in hf_fields.items():
        mine = job_fields.get(key)
        if isinstance(value, dict) and isinstance(mine, dict):  # model.moe, model.rope_scaling
            out[key] = merge_fields(value, mine, f"{where}.{key}")
            continue
        if mine is not None and mine != value:
            raise HFConfigError(
                f"{where}.{key}={mine!r} conflicts with the Hugging Face config.json "
                f"value {value!r}: remove {where}.{key} or set it to {value!r}"
            )
        out[key] = value
    return out


