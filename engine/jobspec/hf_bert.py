"""The BERT masked-LM family's config.json <-> a job's `model` section (arch bert), both directions: what
hf_fields.hf_model_fields and hf_export_config.hf_config_for call for the bert layout.

Dropout probabilities are not read (as for the other families: the job's model.hidden_dropout and
attention_dropout decide); they are written on export.
"""

from __future__ import annotations

from typing import Any

from engine.jobspec.hf_families import HFConfigError, HFFamily


def bert_fields(cfg: dict[str, Any], fam: HFFamily) -> dict[str, Any]:
    """The `model` fields a BERT config.json fixes; HFConfigError naming the field."""
    act = cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise HFConfigError(f"config.json hidden_act={act!r} is not supported for {fam.architecture} (only gelu)")
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise HFConfigError(
            f"config.json position_embedding_type={kind!r} is not supported for {fam.architecture} (only absolute)"
        )
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise HFConfigError(f"config.json is_decoder / add_cross_attention: {fam.architecture} is imported as an encoder")
    heads = int(cfg["num_attention_heads"])
    return {
        "arch": fam.arch,
        "num_layers": int(cfg["num_hidden_layers"]),
        "hidden_size": int(cfg["hidden_size"]),
        "num_attention_heads": heads,
        "num_query_groups": heads,
        "ffn_hidden_size": int(cfg["intermediate_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "type_vocab_size": int(cfg.get("type_vocab_size", 2)),
        "bert_binary_head": fam.binary_head,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "norm_epsilon": float(cfg.get("layer_norm_eps", 1e-12)),
        "activation": "gelu",
        "qkv_bias": True,
    }


def check_bert_positions(cfg: dict[str, Any], seq_length: int) -> None:
    """BERT learns max_position_embeddings positions: the job's sequence must fit in them."""
    positions = int(cfg.get("max_position_embeddings", 512))
    if positions < seq_length:
        raise HFConfigError(
            f"config.json max_position_embeddings={positions} is smaller than model.seq_length={seq_length}: "
            f"set model.seq_length <= {positions} (BERT has that many learned positions)"
        )


def bert_config(model: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json for an arch bert `model` section, over `cfg` (the base the exporter keeps)."""
    cfg.update(
        hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        intermediate_size=model.ffn_hidden_size,
        hidden_act="gelu",
        max_position_embeddings=model.seq_length,
        type_vocab_size=model.type_vocab_size,
        layer_norm_eps=model.norm_epsilon,
        tie_word_embeddings=model.tie_embeddings,
        hidden_dropout_prob=model.hidden_dropout,
        attention_probs_dropout_prob=model.attention_dropout,
    )
    cfg.setdefault("pad_token_id", 0)
    return cfg
