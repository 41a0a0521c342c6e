"""`elastron export`: a checkpoint saved on any layout -> a Hugging Face folder transformers loads.

Round trip: import -> checkpoint before any step -> export in fp32 gives byte-identical tensors. After training on TP=2 / PP=2 the exported model's logits (transformers) equal ours.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from elastron.cli import app
from engine.hf.exporter import export_hf
from engine.launcher import spawn
from tests.engine import hf_harness as h
from tests.engine.test_hf_import import LLAMA

RTOL = 1e-5


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, h.save_tiny(folder, LlamaConfig, LlamaForCausalLM, **LLAMA)


def _train(folder, ckpt, ranks, iters, lr, **sections):
    spec = h.job(
        folder,
        ranks,
        checkpoint={"path": str(ckpt)},
        training={"train_iters": iters},
        optimizer={"lr": lr, "min_lr": 0.0, "weight_decay": 0.0},
        **sections,
    )
    return spawn(h.train_then_logits, ranks, (spec, 300), timeout_s=240)


def test_round_trip_is_byte_identical(llama, tmp_path):
    folder, _ = llama
    spec = h.job(folder, 2, checkpoint={"path": str(tmp_path / "ckpt")}, parallel={"tensor": 2})
    spawn(h.import_save_step, 2, (spec, 300), timeout_s=240)
    out = tmp_path / "hf"
    result = CliRunner().invoke(
        app, ["export", str(tmp_path / "ckpt" / "hf"), "--output", str(out), "--dtype", "fp32"]
    )
    assert result.exit_code == 0, result.output
    assert "exported iteration 0" in result.output
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == exported.keys()
    for name, t in original.items():
        assert t.dtype == exported[name].dtype and torch.equal(t, exported[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 300
    assert (out / "generation_config.json").is_file()


@pytest.mark.parametrize(
    "parallel", [{"tensor": 2, "sequence_parallel": True}, {"pipeline": 2}], ids=["tp2", "pp2"]
)
def test_trained_model_loads_into_transformers_with_our_logits(llama, tmp_path, parallel):
    folder, _ = llama
    got = _train(folder, tmp_path / "ckpt", 2, 2, 1e-2, parallel=parallel)
    ours = next(r["logits"] for r in got if r.get("logits") is not None)[..., :300]
    out = tmp_path / "hf"
    report = export_hf(str(tmp_path / "ckpt" / "hf"), str(out), dtype="fp32", max_shard_bytes=40_000)
    assert report.iteration == 2 and len([f for f in report.files if f.endswith(".safetensors")]) > 1
    assert (out / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens, _ = h.batch(300, 2)
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < RTOL
    before = h.save_tiny  # the import started from the original weights: training moved them
    assert before is not None and not torch.equal(
        load_file(folder / "model.safetensors")["model.norm.weight"], model.model.norm.weight.detach()
    )


def test_default_dtype_is_bf16_and_bad_input_exits_2(llama, tmp_path):
    folder, _ = llama
    _train(folder, tmp_path / "ckpt", 1, 1, 1e-30)
    out = tmp_path / "hf"
    export_hf(str(tmp_path / "ckpt" / "hf" / "iter_0000001"), str(out))
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    runner = CliRunner()
    bad = runner.invoke(
        app, ["export", str(tmp_path / "ckpt" / "hf"), "--output", str(out), "--format", "gguf"]
    )
    assert bad.exit_code == 2 and "--format 'gguf' is not supported" in bad.output
    missing = runner.invoke(app, ["export", str(tmp_path / "nothing"), "--output", str(out)])
    assert missing.exit_code == 2 and "no committed checkpoint" in missing.output
    dtype = runner.invoke(
        app, ["export", str(tmp_path / "ckpt" / "hf"), "--output", str(out), "--dtype", "int8"]
    )
    assert dtype.exit_code == 2 and "--dtype 'int8'" in dtype.output


def test_export_to_s3(llama, tmp_path, s3_bucket):
    import boto3

    folder, _ = llama
    spawn(h.import_save_step, 1, (h.job(folder, 1, checkpoint={"path": str(tmp_path / "ckpt")}), 300), timeout_s=240)
    export_hf(str(tmp_path / "ckpt" / "hf"), f"s3://{s3_bucket}/models/out", dtype="fp32")
    s3 = boto3.client("s3")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix="models/out/")["Contents"]}
    assert {"models/out/config.json", "models/out/generation_config.json", "models/out/model.safetensors"} <= keys
    s3.download_file(s3_bucket, "models/out/model.safetensors", str(tmp_path / "m.safetensors"))
    original, exported = load_file(folder / "model.safetensors"), load_file(tmp_path / "m.safetensors")
    assert all(torch.equal(t, exported[k]) for k, t in original.items())
