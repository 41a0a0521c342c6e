"""model.init_from: a Hugging Face model imported on any layout computes what transformers does.

Tiny random models are built and saved by the test with transformers (fp32, eager attention);
the first micro-batch's logits and the first step's loss are compared with transformers' on the
same tokens, on 1 rank and on TP=2 (+SP), PP=2 and DP=2. The vocabulary (300) is padded to 384
inside the model, so the padded logits' masking is exercised too.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from engine.hf.reader import HFCheckpointError
from engine.jobspec import JobSpecError, parse_job
from engine.launcher import spawn
from tests.engine import hf_harness as h

RTOL = 1e-5
LLAMA = h.TINY_LLAMA


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    model = h.save_tiny(folder, LlamaConfig, LlamaForCausalLM, **LLAMA)
    return folder, model


def _check(folder, model, ranks, **sections):
    spec = h.job(folder, ranks, **sections)
    got = spawn(h.import_forward_step, ranks, (spec, 300), timeout_s=240)
    logits = next(r["logits"] for r in got if r["logits"] is not None)
    ref_logits, _ = h.hf_logits_and_loss(model, 300, 2)
    _, ref_loss = h.hf_logits_and_loss(model, 300, 4)
    assert logits.shape[-1] == 384
    assert torch.isinf(logits[..., 300:]).all(), "padded vocabulary entries must be -inf"
    scale = ref_logits.abs().max()
    assert float((logits[..., :300] - ref_logits).abs().max() / scale) < RTOL
    assert got[0]["loss"] == pytest.approx(ref_loss, rel=RTOL)
    return got


def test_llama_on_one_rank(llama):
    got = _check(*llama, 1)
    assert got[0]["bytes_read"] > 0.95 * got[0]["file_bytes"]


def test_llama_on_tp2_reads_about_half_per_rank(llama):
    got = _check(*llama, 2, parallel={"tensor": 2, "sequence_parallel": True})
    total = got[0]["file_bytes"]
    # Every tensor is read once over both ranks except the norms (read whole by both); the
    # vocabulary (300 of 384 padded rows) splits 192/108, so the ranks' shares differ a little.
    assert 0.95 < sum(r["bytes_read"] for r in got) / total < 1.05
    for r in got:
        assert 0.35 < r["bytes_read"] / total < 0.65, r


def test_llama_on_pp2(llama):
    _check(*llama, 2, parallel={"pipeline": 2})


def test_llama_on_dp2(llama):
    _check(*llama, 2)


def test_mistral_on_tp2(tmp_path):
    model = h.save_tiny(tmp_path, MistralConfig, MistralForCausalLM, sliding_window=32, **LLAMA)
    _check(tmp_path, model, 2, parallel={"tensor": 2})


def test_architecture_comes_from_config_json(llama):
    spec = parse_job(h.job(llama[0]))
    m = spec.model
    assert (m.arch, m.num_layers, m.hidden_size, m.num_query_groups, m.ffn_hidden_size, m.vocab_size) == (
        "llama",
        2,
        32,
        2,
        64,
        300,
    )
    assert m.rotary_base == 500000.0 and m.norm_epsilon == 1e-6
    with pytest.raises(JobSpecError, match="model.hidden_size=64 conflicts .* value 32"):
        parse_job(h.job(llama[0], model={"hidden_size": 64}))


def test_a_wrong_folder_names_the_tensor(tmp_path, llama):
    from safetensors.torch import load_file, save_file

    folder, _ = llama
    for name in ("config.json",):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="has no tensor model.layers.1.mlp.up_proj.weight"):
        spawn(h.import_forward_step, 1, (h.job(tmp_path), 300), timeout_s=120)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"] = tensors["model.layers.0.self_attn.o_proj.weight"][
        :, :16
    ].contiguous()
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"o_proj.weight has shape \[32, 16\]"):
        spawn(h.import_forward_step, 1, (h.job(tmp_path), 300), timeout_s=120)
    del tensors["model.layers.0.self_attn.o_proj.weight"]
    tensors["model.layers.0.self_attn.o_proj.weight"] = load_file(folder / "model.safetensors")[
        "model.layers.0.self_attn.o_proj.weight"
    ]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="tensors this model does not use: model.extra.weight"):
        spawn(h.import_forward_step, 1, (h.job(tmp_path), 300), timeout_s=120)
    assert issubclass(HFCheckpointError, ValueError)


def test_from_s3_with_its_tokenizer_by_ranged_reads(tmp_path, s3_bucket, s3_env):
    model = h.save_tiny(tmp_path, LlamaConfig, LlamaForCausalLM, **LLAMA)
    h.write_tokenizer(tmp_path, 300)
    uri = h.upload(tmp_path, s3_bucket, "models/tiny")
    # Ranks fork from a server started before this test: hand them its AWS settings.
    aws_env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    spec = h.job(uri, 2, parallel={"tensor": 2})
    del spec["data"]["tokenizer"]
    assert parse_job(spec).data.tokenizer == f"hf:{uri}"  # the folder's own tokenizer by default
    got = spawn(h.import_forward_step, 2, (spec, 300), timeout_s=240, env=aws_env)
    ref_logits, _ = h.hf_logits_and_loss(model, 300, 2)
    logits = got[0]["logits"][..., :300]
    assert float((logits - ref_logits).abs().max() / ref_logits.abs().max()) < RTOL
    # Column-split weights (o_proj, down_proj) are read as one span per rank on S3 (see
    # engine/hf/reader.py): more than half, never the whole folder per rank.
    for r in got:
        assert r["bytes_read"] / r["file_bytes"] < 0.8, r


def test_resume_continues_from_the_checkpoint_not_the_import(tmp_path, llama):
    folder, _ = llama
    ckpt = {"path": str(tmp_path / "ckpt"), "interval": 2}
    whole = spawn(
        h.train_then_logits,
        2,
        (h.job(folder, 2, parallel={"tensor": 2}, checkpoint=ckpt, training={"train_iters": 4}), 300),
        timeout_s=240,
    )
    first = spawn(
        h.train_then_logits,
        2,
        (
            h.job(
                folder,
                2,
                parallel={"tensor": 2},
                checkpoint={"path": str(tmp_path / "c2"), "interval": 2},
                training={"train_iters": 4},
            ),
            300,
            2,
        ),
        timeout_s=240,
    )
    # Resumed on one rank (another layout): the checkpoint's weights, not the HF folder's.
    rest = spawn(
        h.train_then_logits,
        1,
        (
            h.job(
                folder,
                1,
                checkpoint={"path": str(tmp_path / "c2"), "interval": 2},
                training={"train_iters": 4},
            ),
            300,
        ),
        timeout_s=240,
    )
    assert rest[0]["imported"] is False and first[0]["imported"] is True
    assert first[0]["losses"] + rest[0]["losses"] == pytest.approx(whole[0]["losses"], rel=RTOL)
