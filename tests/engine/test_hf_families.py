"""Every supported Hugging Face family, imported and exported: tiny random models of each are
built here with transformers (fp32, eager attention, no download).

Per family: on one rank, the imported model's logits and first-step loss equal transformers'
(1e-5 relative), and exporting a checkpoint saved before the first step gives back
byte-identical tensors and an equivalent config.json; on one parallel layout that exercises the
family's own tensors (TP=2 for fused biases and q/k norms, EP=2 for experts), the logits and
loss equal transformers' too.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from engine.hf.exporter import export_hf
from engine.jobspec.hf_config import read_hf_config
from engine.jobspec.hf_fields import hf_model_fields
from engine.launcher import spawn
from tests.engine import hf_harness as h

RTOL = 1e-5
VOCAB = 300
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
# YaRN (Qwen's long-context setting): a 4x context, the ramp's bounds inside the 8 frequencies.
QWEN_YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
NO_AUX = {"model": {"moe": {"aux_loss_coeff": 0.0}}}
TP2 = {"parallel": {"tensor": 2}}
EP2 = {"parallel": {"expert": 2}}
FAMILIES = {
    # name: (config class, model class, config fields, job sections, the parallel layout)
    "llama3.1": (LlamaConfig, LlamaForCausalLM, dict(BASE, rope_parameters=LLAMA31_ROPE), {}, TP2),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(BASE, tie_word_embeddings=True), {}, TP2),
    "qwen2-yarn": (Qwen2Config, Qwen2ForCausalLM, dict(BASE, rope_parameters=QWEN_YARN_ROPE), {}, TP2),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(BASE, head_dim=16), {}, TP2),
    "gpt2": (
        GPT2Config,
        GPT2LMHeadModel,
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=h.SEQ),
        {},
        TP2,
    ),
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(BASE, num_local_experts=4, num_experts_per_tok=2),
        NO_AUX,
        EP2,
    ),
    "qwen3-moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            BASE,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            norm_topk_prob=True,
        ),
        NO_AUX,
        EP2,
    ),
}


def _folder(tmp_path, name):
    config_cls, model_cls, fields, _, _ = FAMILIES[name]
    if name == "gpt2":
        fields = dict(fields, bos_token_id=0, eos_token_id=0)
    return h.save_tiny(tmp_path / name, config_cls, model_cls, **fields)


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours[..., :VOCAB] - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_rank_import_matches_and_export_round_trips(tmp_path, name):
    model = _folder(tmp_path, name)
    folder, sections = tmp_path / name, FAMILIES[name][3]
    spec = h.job(folder, 1, checkpoint={"path": str(tmp_path / "ckpt")}, **sections)
    got = spawn(h.import_save_step, 1, (spec, VOCAB), timeout_s=240)[0]
    ref_logits, _ = h.hf_logits_and_loss(model, VOCAB, 2)
    _, ref_loss = h.hf_logits_and_loss(model, VOCAB, 4)
    assert _close(got["logits"], ref_logits) < RTOL
    assert got["loss"] == pytest.approx(ref_loss, rel=RTOL)

    out = tmp_path / "exported"
    export_hf(str(tmp_path / "ckpt" / "hf" / "iter_0000000"), str(out), dtype="fp32")
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == exported.keys()
    for key, t in original.items():
        assert torch.equal(t, exported[key]), key
    assert hf_model_fields(read_hf_config(out)) == hf_model_fields(read_hf_config(folder))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_parallel_import_matches_transformers(tmp_path, name):
    model = _folder(tmp_path, name)
    sections = {**FAMILIES[name][3], **FAMILIES[name][4]}
    got = spawn(h.import_forward_step, 2, (h.job(tmp_path / name, 2, **sections), VOCAB), timeout_s=240)
    ref_logits, _ = h.hf_logits_and_loss(model, VOCAB, 2)
    _, ref_loss = h.hf_logits_and_loss(model, VOCAB, 4)
    for r in got:
        if r["logits"] is not None:
            assert _close(r["logits"], ref_logits) < RTOL
    assert got[0]["loss"] == pytest.approx(ref_loss, rel=RTOL)


def test_exported_config_loads_in_transformers(tmp_path):
    """A model that was never imported (random init, Qwen3 settings) exports as a Qwen3 folder
    transformers reads, with our logits."""
    spec = h.job(tmp_path / "none", 1, checkpoint={"path": str(tmp_path / "ckpt")})
    spec["model"] = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "kv_channels": 16,
        "qk_layernorm": True,
        "seq_length": h.SEQ,
        "vocab_size": VOCAB,
    }
    got = spawn(h.train_then_logits, 1, (spec, VOCAB), timeout_s=240)[0]
    out = tmp_path / "exported"
    export_hf(str(tmp_path / "ckpt" / "hf"), str(out), dtype="fp32")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = theirs(input_ids=h.batch(VOCAB, 2)[0]).logits
    assert _close(got["logits"], logits) < RTOL


DEEPSEEK = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
    max_position_embeddings=64,
    routed_scaling_factor=2.5,
)


# DeepSeek-V3's published rope setting, shrunk: YaRN with mscale = mscale_all_dim (so the cos/sin
# factor is 1) and MLA's softmax scaled by mscale(factor, mscale_all_dim)^2.
DEEPSEEK_YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _tiny_deepseek(folder, **fields):
    """A tiny DeepSeek-V3: MLA (interleaved RoPE rows), a dense first layer, then group-routed
    experts with a random score-correction bias and a shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(**DEEPSEEK, **fields)
    config.architectures = ["DeepseekV3ForCausalLM"]
    model = DeepseekV3ForCausalLM(config).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.normal_(0, 0.5)  # HF initialises routers to zero
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return _tiny_deepseek(tmp_path_factory.mktemp("deepseek"))


@pytest.mark.parametrize("ranks", [1, 2], ids=["1", "tp2-sp"])
def test_deepseek_v3_with_yarn_imports_equal_to_transformers_and_exports_its_rope(tmp_path, ranks):
    folder, model = _tiny_deepseek(tmp_path / "deepseek-yarn", rope_parameters=DEEPSEEK_YARN_ROPE)
    parallel = {"tensor": 2, "sequence_parallel": True} if ranks == 2 else {}
    spec = h.job(folder, ranks, parallel=parallel, checkpoint={"path": str(tmp_path / "ckpt")}, **NO_AUX)
    got = spawn(h.import_save_step, ranks, (spec, VOCAB), timeout_s=240)
    ref_logits, _ = h.hf_logits_and_loss(model, VOCAB, 2)
    _, ref_loss = h.hf_logits_and_loss(model, VOCAB, 4)
    assert _close(next(r["logits"] for r in got if r["logits"] is not None), ref_logits) < RTOL
    assert got[0]["loss"] == pytest.approx(ref_loss, rel=RTOL)
    out = tmp_path / "exported"
    export_hf(str(tmp_path / "ckpt" / "hf" / "iter_0000000"), str(out), dtype="fp32")
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert {k: rope[k] for k in DEEPSEEK_YARN_ROPE} == DEEPSEEK_YARN_ROPE


@pytest.mark.parametrize(
    ("ranks", "parallel"),
    [(1, {}), (2, {"expert": 2}), (2, {"tensor": 2, "sequence_parallel": True}), (2, {"pipeline": 2})],
    ids=["1", "ep2", "tp2-sp", "pp2"],
)
def test_deepseek_v3_imports_equal_to_transformers(deepseek, ranks, parallel):
    folder, model = deepseek
    spec = h.job(folder, ranks, parallel=parallel, **NO_AUX)
    got = spawn(h.import_forward_step, ranks, (spec, VOCAB), timeout_s=240)
    ref_logits, _ = h.hf_logits_and_loss(model, VOCAB, 2)
    _, ref_loss = h.hf_logits_and_loss(model, VOCAB, 4)
    logits = next(r["logits"] for r in got if r["logits"] is not None)
    assert _close(logits, ref_logits) < RTOL
    assert got[0]["loss"] == pytest.approx(ref_loss, rel=RTOL)


def test_deepseek_v3_export_round_trips(deepseek, tmp_path):
    folder, _ = deepseek
    spawn(
        h.import_save_step,
        1,
        (h.job(folder, 1, checkpoint={"path": str(tmp_path / "ckpt")}, **NO_AUX), VOCAB),
        timeout_s=240,
    )
    out = tmp_path / "exported"
    export_hf(str(tmp_path / "ckpt" / "hf" / "iter_0000000"), str(out), dtype="fp32")
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == exported.keys()
    for key, t in original.items():
        assert torch.equal(t, exported[key]), key
    assert hf_model_fields(read_hf_config(out)) == hf_model_fields(read_hf_config(folder))


def test_deepseek_v3_multi_token_prediction_layers_in_the_checkpoint_are_skipped(deepseek, tmp_path):
    """The published DeepSeek-V3 stores its MTP module as the layer after the last
    (num_nextn_predict_layers); transformers does not read it and neither does the import: the
    model equals transformers'. Without that config field the same tensors are refused by name."""
    import shutil

    from safetensors.torch import save_file

    folder, model = deepseek
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(32, 64)
    tensors["model.layers.2.enorm.weight"] = torch.ones(32)
    config = json.loads((folder / "config.json").read_text())
    for name, nextn in (("with-mtp", 1), ("without", 0)):
        out = tmp_path / name
        shutil.copytree(folder, out)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": nextn}))
    got = spawn(h.import_forward_step, 1, (h.job(tmp_path / "with-mtp", 1, **NO_AUX), VOCAB), timeout_s=240)
    ref_logits, _ = h.hf_logits_and_loss(model, VOCAB, 2)
    assert _close(got[0]["logits"], ref_logits) < RTOL
    with pytest.raises(Exception, match=r"model\.layers\.2\.eh_proj\.weight"):
        spawn(h.import_forward_step, 1, (h.job(tmp_path / "without", 1, **NO_AUX), VOCAB), timeout_s=240)


def test_deepseek_v3_mtp_depths_are_exported_as_its_nextn_layers_and_imported_back(deepseek, tmp_path):
    """A job with model.mtp_num_layers: 1 imports a DeepSeek-V3 checkpoint that has no MTP layer
    (its depth starts from our initialisation; the main model still equals transformers'),
    exports the depth as layer num_layers + 0 with num_nextn_predict_layers: 1 (transformers
    still loads the folder), and a job importing that folder reads the depth back: exporting
    it again gives the same bytes, the MTP layer included."""
    from transformers import AutoModelForCausalLM

    folder, model = deepseek
    mtp = {"model": {"mtp_num_layers": 1, "moe": {"aux_loss_coeff": 0.0}}}
    first = spawn(
        h.import_save_step, 1, (h.job(folder, 1, checkpoint={"path": str(tmp_path / "a")}, **mtp), VOCAB), timeout_s=240
    )[0]
    ref_logits, _ = h.hf_logits_and_loss(model, VOCAB, 2)
    assert _close(first["logits"], ref_logits) < RTOL
    once = tmp_path / "once"
    export_hf(str(tmp_path / "a" / "hf" / "iter_0000000"), str(once), dtype="fp32")
    assert json.loads((once / "config.json").read_text())["num_nextn_predict_layers"] == 1
    exported = load_file(once / "model.safetensors")
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.shared_head.norm.weight"} <= exported.keys()
    theirs = AutoModelForCausalLM.from_pretrained(once, attn_implementation="eager").eval()
    with torch.no_grad():
        assert _close(first["logits"], theirs(input_ids=h.batch(VOCAB, 2)[0]).logits) < RTOL

    spawn(h.import_save_step, 1, (h.job(once, 1, checkpoint={"path": str(tmp_path / "b")}, **mtp), VOCAB), timeout_s=240)
    twice = tmp_path / "twice"
    export_hf(str(tmp_path / "b" / "hf" / "iter_0000000"), str(twice), dtype="fp32")
    again = load_file(twice / "model.safetensors")
    assert exported.keys() == again.keys()
    for key, t in exported.items():
        assert torch.equal(t, again[key]), key
