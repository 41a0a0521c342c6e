"""The model registry (engine/models/__init__.py) and the base every family shares
(engine/models/language_model.py)."""

from __future__ import annotations

import typing

import pytest

from engine.jobspec.model import ModelSpec
from engine.models import MODEL_FAMILIES, BertModel, GPTModel, LanguageModel, T5Model, model_family


def test_every_arch_the_job_spec_accepts_has_a_family():
    archs = set(typing.get_args(ModelSpec.model_fields["arch"].annotation))
    assert set(MODEL_FAMILIES) == archs
    assert model_family("llama") is model_family("gpt2") is GPTModel
    assert (model_family("bert"), model_family("t5")) == (BertModel, T5Model)
    with pytest.raises(KeyError):
        model_family("mamba")


@pytest.mark.parametrize("family", [GPTModel, BertModel, T5Model])
def test_families_share_the_output_and_loss_instead_of_borrowing_them(family):
    assert issubclass(family, LanguageModel)
    for name in ("_mask_vocab_padding", "loss_from_logits", "_loss_or_logits"):
        assert name not in vars(family), f"{family.__name__} defines its own {name}"
    for name in ("fsdp_units", "global_param_name"):  # the engine's interface, each family's own
        assert callable(getattr(family, name))
    assert "fsdp_units" in vars(family), f"{family.__name__} has no fsdp_units of its own"
