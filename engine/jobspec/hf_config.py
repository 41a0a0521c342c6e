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


# architectures[0] -> our `model.arch`. Qwen2 (qkv bias) and Qwen3 (qk norm) join once ModelSpec
# has `qkv_bias` / `qk_layernorm`; GPT-2 once its activation (gelu_new) is a ModelSpec choice.
FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
}


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


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers 5 keeps rope settings in `rope_parameters`; 4.x in `rope_theta` / `rope_scaling`.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for src, name in ((params, "rope_parameters"), (scaling, "rope_scaling")):
        kind = src.get("rope_type", src.get("type", "default"))
        if kind not in ("default", None):
            raise HFConfigError(f"config.json {name}.rope_type={kind!r} is not supported (only default RoPE)")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta)


def hf_model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `model` fields config.json fixes, or HFConfigError naming the unsupported field."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in FAMILIES:
        raise HFConfigError(
            f"config.json architectures={archs!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"config.json hidden_act={act!r} is not supported for {arch} (only silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise HFConfigError(f"config.json {flag}=true is not supported for {arch}")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise HFConfigError(
            f"config.json head_dim={head_dim} differs from hidden_size/num_attention_heads "
            f"({hidden // heads}); not supported yet"
        )
    return {
        "arch": FAMILIES[arch],
        "num_layers": int(cfg["num_hidden_layers"]),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": int(cfg.get("num_key_value_heads") or heads),
        "ffn_hidden_size": int(cfg["intermediate_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "rotary_base": _rope_theta(cfg),
    }


def check_sliding_window(cfg: dict[str, Any], seq_length: int) -> None:
    """Mistral's sliding window must cover the whole sequence (we run full causal attention)."""
    window = cfg.get("sliding_window")
    if window is not None and int(window) < seq_length:
        raise HFConfigError(
            f"config.json sliding_window={window} is smaller than model.seq_length={seq_length}: "
            f"set model.seq_length <= {window} (sliding-window attention is not supported)"
        )


def merge_fields(hf_fields: dict[str, Any], job_fields: dict[str, Any]) -> dict[str, Any]:
    """The job's `model` section with config.json's fields; a field set to another value fails
    naming both values."""
    for key, value in hf_fields.items():
        if key in job_fields and job_fields[key] is not None and job_fields[key] != value:
            raise HFConfigError(
                f"model.{key}={job_fields[key]!r} conflicts with the Hugging Face config.json "
                f"value {value!r}: remove model.{key} or set it to {value!r}"
            )
    return {**job_fields, **hf_fields}


def hf_config_for(model: Any, base: dict[str, Any] | None = None, *, dtype: str = "bf16") -> dict[str, Any]:
    """config.json for a job's `model` section (a ModelSpec): over `base` (the config.json the
    job was imported from, so its token ids and other fields survive) when there is one. The
    inverse of hf_model_fields for every field that function reads."""
    cfg = dict(base or {})
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in FAMILIES or FAMILIES[arch] != model.arch:
        arch = {"llama": "LlamaForCausalLM"}.get(model.arch)
        if arch is None:
            raise HFConfigError(f"model.arch={model.arch!r} has no Hugging Face export yet")
        cfg = {k: v for k, v in cfg.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    cfg.update(
        architectures=[arch],
        model_type=_MODEL_TYPES[arch],
        vocab_size=model.vocab_size,
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
        attention_bias=False,
        mlp_bias=False,
        dtype={"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype],
    )
    cfg.pop("torch_dtype", None)
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": model.rotary_base}
    cfg["rope_theta"] = model.rotary_base
    return cfg


_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
