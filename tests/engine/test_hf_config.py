"""config.json -> model fields (engine/jobspec/hf_fields.py), from real transformers configs."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, MistralConfig

from engine.jobspec import ModelSpec
from engine.jobspec.hf_config import HFConfigError, read_hf_config
from engine.jobspec.hf_fields import check_sliding_window, hf_model_fields, merge_fields

TINY = dict(
    vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
)


def _saved(tmp_path, config):
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(tmp_path)
    return read_hf_config(tmp_path)


def test_llama_fields_build_a_model_spec(tmp_path):
    fields = hf_model_fields(_saved(tmp_path, LlamaConfig(**TINY, rope_theta=500000.0)))
    assert fields == {
        "arch": "llama", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        "num_query_groups": 2, "ffn_hidden_size": 64, "vocab_size": 100, "tie_embeddings": False,
        "norm_epsilon": 1e-6, "rotary_base": 500000.0, "qkv_bias": False, "qk_layernorm": False,
    }
    ModelSpec(**fields)


def test_mistral_sliding_window_must_cover_the_sequence(tmp_path):
    cfg = _saved(tmp_path, MistralConfig(**TINY, sliding_window=64))
    assert hf_model_fields(cfg)["arch"] == "llama"
    check_sliding_window(cfg, 64)
    with pytest.raises(HFConfigError, match="sliding_window=64 is smaller than model.seq_length=128"):
        check_sliding_window(cfg, 128)


def test_unsupported_config_fields_are_named(tmp_path):
    cfg = _saved(tmp_path, LlamaConfig(**TINY))
    with pytest.raises(HFConfigError, match="hidden_act='gelu'"):
        hf_model_fields({**cfg, "hidden_act": "gelu"})
    with pytest.raises(HFConfigError, match="attention_bias"):
        hf_model_fields({**cfg, "attention_bias": True})
    with pytest.raises(HFConfigError, match="architectures=\\['GPTNeoXForCausalLM'\\]"):
        hf_model_fields({**cfg, "architectures": ["GPTNeoXForCausalLM"]})
    with pytest.raises(HFConfigError, match="has no config.json"):
        read_hf_config(tmp_path / "nowhere")


def test_conflicting_job_field_names_both_values(tmp_path):
    fields = hf_model_fields(_saved(tmp_path, LlamaConfig(**TINY)))
    assert merge_fields(fields, {"hidden_size": 32, "seq_length": 64})["seq_length"] == 64
    with pytest.raises(HFConfigError, match="model.hidden_size=64 conflicts .* value 32"):
        merge_fields(fields, {"hidden_size": 64})
