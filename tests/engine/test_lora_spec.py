"""`model.lora`: defaults as PEFT's, our names and Hugging Face names for the same projections,
and every refusal naming the field and the fix."""

from __future__ import annotations

import pytest

from engine.jobspec import parse_job
from tests.engine.test_jobspec import job, refused


def lora_job(lora: dict | None = None, **model) -> dict:
    return job(model={**model, "lora": lora if lora is not None else {}})


def test_defaults_are_peft_defaults_for_llama():
    lora = parse_job(lora_job()).model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.init, lora.init_from) == (8, 16.0, 0.0, "kaiming", None)
    assert lora.projections(gated=True) == ("q_proj", "v_proj")
    assert lora.scaling == 2.0


def test_no_lora_dumps_as_before():
    assert "lora" not in parse_job(job()).model_dump(mode="json")["model"]


@pytest.mark.parametrize(
    ("targets", "gated", "expected"),
    [
        (["linear_qkv"], True, ("q_proj", "k_proj", "v_proj")),
        (["v_proj", "q_proj"], True, ("q_proj", "v_proj")),
        (["linear_proj", "down_proj"], True, ("o_proj", "down_proj")),
        (["linear_fc1"], True, ("gate_proj", "up_proj")),
        (["linear_fc1"], False, ("up_proj",)),
        (["gate_proj", "linear_fc1", "linear_fc2", "o_proj"], True, ("o_proj", "gate_proj", "up_proj", "down_proj")),
    ],
)
def test_our_names_and_hf_names_map_to_projections(targets, gated, expected):
    model = {} if gated else {"arch": "gpt2"}
    lora = parse_job(lora_job({"target_modules": targets}, **model)).model.lora
    assert lora.projections(gated=gated) == expected


def test_unknown_target_names_the_field_and_the_choices():
    refused(lora_job({"target_modules": ["q_proj", "qkv"]}), r"model\.lora.*unknown module 'qkv': use linear_qkv.*q_proj")


@pytest.mark.parametrize(
    ("lora", "pattern"),
    [
        ({"rank": 0}, r"model\.lora\.rank"),
        ({"alpha": 0}, r"model\.lora\.alpha"),
        ({"dropout": 1.0}, r"model\.lora\.dropout"),
        ({"init": "pissa"}, r"model\.lora\.init"),
        ({"target_modules": []}, r"model\.lora\.target_modules"),
        ({"ranks": 8}, r"model\.lora\.ranks"),
    ],
)
def test_bad_values_name_the_field(lora, pattern):
    refused(lora_job(lora), pattern)


def test_experts_refuse_lora():
    moe = {"moe": {"num_experts": 4}}
    refused(lora_job(**moe), r"model\.lora: LoRA on Mixture-of-Experts models is not supported.*remove model\.lora")


def test_gate_proj_needs_a_gated_mlp():
    refused(lora_job({"target_modules": ["gate_proj"]}, arch="gpt2"), r"gate_proj needs a gated MLP.*use up_proj")


def test_mla_and_mtp_refuse_lora():
    mla = {"attention": "mla", "mla": {"kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}}
    refused(lora_job(**mla), r"model\.lora: LoRA with model\.attention: mla")
    refused(lora_job(mtp_num_layers=1), r"model\.lora: LoRA with model\.mtp_num_layers")
