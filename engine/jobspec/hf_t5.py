"""The Hugging Face T5 family's config.json <-> the `model` section (model.arch t5), both ways:
`t5_fields` for import (hf_fields.hf_model_fields) and `t5_hf_config` for `elastron export`
(hf_export_config.hf_config_for). Plain data, no torch.

Tying. transformers 5 always ties T5's LM head to the shared embedding and reads the old
`tie_word_embeddings` flag only as `scale_decoder_outputs` (hidden_size**-0.5 before the head;
original T5 with a tied head, not v1.1); a 4.x T5 v1.1 folder says `tie_word_embeddings: false`
and carries its own `lm_head.weight`. So: `model.tie_embeddings` is config.json's
tie_word_embeddings (default true), and `model.t5.scale_decoder_outputs` its
scale_decoder_outputs, else tie_word_embeddings.
"""

from __future__ import annotations

from typing import Any

from engine.jobspec.hf_families import HFConfigError, HFFamily

_KEEP = ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id")


def t5_fields(cfg: dict[str, Any], fam: HFFamily) -> dict[str, Any]:
    """The `model` fields a T5 config.json fixes; HFConfigError naming what we do not run."""
    proj = cfg.get("feed_forward_proj", "relu")
    if proj != "gated-gelu":
        raise HFConfigError(
            f"config.json feed_forward_proj={proj!r} is not supported for {fam.architecture}: model.arch t5 is "
            "T5 v1.1's gated-gelu"
        )
    if cfg.get("is_encoder_decoder", True) is False:
        raise HFConfigError(f"config.json is_encoder_decoder=false is not supported for {fam.architecture}")
    tie = bool(cfg.get("tie_word_embeddings", True))
    heads = int(cfg.get("num_heads", 8))
    num_layers = int(cfg.get("num_layers", 6))
    pad = cfg.get("pad_token_id")
    start = cfg.get("decoder_start_token_id", pad if pad is not None else 0)
    return {
        "arch": fam.arch,
        "num_layers": num_layers,
        "hidden_size": int(cfg.get("d_model", 512)),
        "num_attention_heads": heads,
        "num_query_groups": heads,
        "kv_channels": int(cfg.get("d_kv", 64)),
        "ffn_hidden_size": int(cfg.get("d_ff", 2048)),
        "vocab_size": int(cfg["vocab_size"]),
        "norm_epsilon": float(cfg.get("layer_norm_epsilon", 1e-6)),
        "activation": "gelu_tanh",
        "tie_embeddings": tie,
        "t5": {
            "num_decoder_layers": int(cfg.get("num_decoder_layers") or num_layers),
            "relative_attention_num_buckets": int(cfg.get("relative_attention_num_buckets", 32)),
            "relative_attention_max_distance": int(cfg.get("relative_attention_max_distance", 128)),
            "scale_decoder_outputs": bool(cfg.get("scale_decoder_outputs", tie)),
            "decoder_start_token_id": int(start),
        },
    }


def t5_hf_config(model: Any, fam: HFFamily, base: dict[str, Any] | None, dtype: str) -> dict[str, Any]:
    """config.json for a T5 `model` section, over `base` (the config.json it was imported from)
    when that is a T5 one, else keeping only its token ids."""
    cfg = dict(base or {})
    if (cfg.get("architectures") or [None])[0] != fam.architecture:
        cfg = {k: v for k, v in cfg.items() if k in _KEEP}
    cfg.pop("torch_dtype", None)
    t5 = model.t5
    cfg.update(
        architectures=[fam.architecture],
        model_type=fam.model_type,
        vocab_size=model.vocab_size,
        d_model=model.hidden_size,
        d_kv=model.head_dim,
        d_ff=model.ffn_hidden_size,
        num_layers=model.num_layers,
        num_decoder_layers=t5.num_decoder_layers,
        num_heads=model.num_attention_heads,
        relative_attention_num_buckets=t5.relative_attention_num_buckets,
        relative_attention_max_distance=t5.relative_attention_max_distance,
        layer_norm_epsilon=model.norm_epsilon,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_gated_act=True,
        is_encoder_decoder=True,
        tie_word_embeddings=model.tie_embeddings,
        scale_decoder_outputs=t5.scale_decoder_outputs,
        decoder_start_token_id=t5.decoder_start_token_id,
    )
    cfg.setdefault("pad_token_id", t5.decoder_start_token_id)
    cfg["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    return cfg
