"""A Hugging Face model folder's config.json -> the `model` fields it fixes (plain json only).

engine/jobspec imports nothing else of the engine, so this reads config.json with `json` (and,
for an `s3://` folder, one GET with boto3's default credential and endpoint chain, e.g.
AWS_ENDPOINT_URL) and maps it with a per-family table. `ModelSpec`'s `model.init_from` validator
and the importer/exporter (engine/hf/) share it, so the API, `elastron train` and the ranks see the
same architecture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class HFConfigError(ValueError):
    """A config.json this engine cannot run; the message names the config field."""


# architectures[0] -> our `model.arch`. Qwen2-MoE is left out: its shared expert has a sigmoid
# gate our MoE does not have.
FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
    "DeepseekV3ForCausalLM": "llama",
}
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GPT2LMHeadModel": "gpt2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Families whose models are another's with the same settings, kept when exporting a job imported
# from one (Mistral's sliding window covers the whole sequence whenever it was imported).
_SAME_TENSORS = {"MistralForCausalLM": "LlamaForCausalLM"}
_QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """config.json of a local folder or an s3://bucket/prefix folder."""
    folder = str(folder)
    if folder.startswith("s3://"):
        where, text = f"{folder.rstrip('/')}/config.json", _read_s3_text(folder, "config.json")
    else:
        path = Path(folder).expanduser() / "config.json"
        if not path.is_file():
            raise HFConfigError(f"model.init_from: {folder} has no config.json")
        where, text = str(path), path.read_text()
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise HFConfigError(f"model.init_from: {where} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise HFConfigError(f"model.init_from: {where} is not a JSON object")
    return cfg


def has_tokenizer(folder: str) -> bool:
    """Whether a model folder ships a fast tokenizer (tokenizer.json), the default data.tokenizer."""
    if not folder.startswith("s3://"):
        return (Path(folder).expanduser() / "tokenizer.json").is_file()
    try:
        _read_s3_text(folder, "tokenizer_config.json")
        return True
    except HFConfigError:
        return False


def _read_s3_text(folder: str, name: str) -> str:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = folder[len("s3://") :].partition("/")
    key = f"{prefix.strip('/')}/{name}".lstrip("/")
    try:
        body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"]
        return body.read().decode("utf-8")
    except (ClientError, BotoCoreError) as e:
        raise HFConfigError(f"model.init_from: cannot read s3://{bucket}/{key}: {e}") from e


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


# yarn's parameters without a default value: in config.json only when they have one.
YARN_OPTIONAL = ("mscale", "mscale_all_dim", "attention_factor")


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


def hf_model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `model` fields config.json fixes, or HFConfigError naming the unsupported field."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in FAMILIES:
        raise HFConfigError(
            f"config.json architectures={archs!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    if arch == "GPT2LMHeadModel":
        return _gpt2_fields(cfg)
    if arch == "DeepseekV3ForCausalLM":
        return _deepseek_fields(cfg)
    return _llama_style_fields(cfg, arch)


def _deepseek_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3: multi-latent attention, dense first `first_k_dense_replace` layers, then MoE
    layers routed by sigmoid scores with a correction bias, in groups, with shared experts."""
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise HFConfigError(f"config.json {flag}=true is not supported for DeepseekV3ForCausalLM")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"config.json hidden_act={cfg.get('hidden_act')!r} is not supported (only silu)")
    heads, n = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    fields: dict[str, Any] = {
        "arch": "llama",
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


def _llama_style_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
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
        "arch": "llama",
        "num_layers": int(cfg["num_hidden_layers"]),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": int(cfg.get("num_key_value_heads") or heads),
        "ffn_hidden_size": int(cfg["intermediate_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "qkv_bias": arch == "Qwen2ForCausalLM",
        "qk_layernorm": arch in _QK_NORM,
        **_rope_fields(cfg),
    }
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        fields["kv_channels"] = int(head_dim)
    if arch == "MixtralForCausalLM":
        fields["moe"] = {
            "num_experts": int(cfg["num_local_experts"]),
            "top_k": int(cfg["num_experts_per_tok"]),
            "norm_topk_prob": True,  # Mixtral: softmax over the k picked experts' logits
        }
    elif arch == "Qwen3MoeForCausalLM":
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


def _gpt2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise HFConfigError(f"config.json activation_function={act!r} is not supported for GPT2LMHeadModel")
    for flag, ok in (
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("scale_attn_weights", True),
    ):
        if bool(cfg.get(flag, ok)) != ok:
            raise HFConfigError(f"config.json {flag}={cfg.get(flag)!r} is not supported for GPT2LMHeadModel")
    hidden = int(cfg["n_embd"])
    return {
        "arch": "gpt2",
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


def hf_config_for(model: Any, base: dict[str, Any] | None = None, *, dtype: str = "bf16") -> dict[str, Any]:
    """config.json for a job's `model` section (a ModelSpec): over `base` (the config.json the
    job was imported from, so its token ids and other fields survive) when it is of the same
    family. The inverse of hf_model_fields for every field that function reads."""
    arch = _family_of(model)
    cfg = dict(base or {})
    base_arch = (cfg.get("architectures") or [None])[0]
    if _SAME_TENSORS.get(base_arch) == arch:  # e.g. Mistral: Llama's tensors and settings
        arch = base_arch
    if base_arch != arch:
        cfg = {k: v for k, v in cfg.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for key in ("torch_dtype", "rope_scaling", "rope_theta", "rope_parameters"):
        cfg.pop(key, None)
    cfg.update(architectures=[arch], model_type=_MODEL_TYPES[arch], vocab_size=model.vocab_size)
    cfg["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    if arch == "DeepseekV3ForCausalLM":
        return _deepseek_config(model, cfg)
    if arch == "GPT2LMHeadModel":
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
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        cfg.update(attention_bias=False)
    if arch == "LlamaForCausalLM":
        cfg.update(mlp_bias=False)
    cfg["rope_parameters"] = _rope_parameters(model)
    moe = model.moe
    if arch == "MixtralForCausalLM":
        cfg.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k)
    elif arch == "Qwen3MoeForCausalLM":
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


def _family_of(model: Any) -> str:
    """The Hugging Face architecture that holds a model of these settings, or HFConfigError
    naming the setting no family has."""
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
        return "DeepseekV3ForCausalLM"
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
        return "GPT2LMHeadModel"
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
            return "Qwen3MoeForCausalLM"
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
        return "MixtralForCausalLM"
    if model.qk_layernorm:
        if model.qkv_bias:
            raise HFConfigError(
                "qkv_bias with qk_layernorm has no Hugging Face family (Qwen3 has neither bias)"
            )
        return "Qwen3ForCausalLM"
    return "Qwen2ForCausalLM" if model.qkv_bias else "LlamaForCausalLM"


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
