"""A LoRA job out and back in PEFT's format: `elastron export --format peft` writes a folder
`peft.PeftModel.from_pretrained` loads onto the base with our logits (1e-5); `--format hf
--merge-lora` writes a plain model transformers loads with the same logits; `model.lora.init_from`
brings an exported adapter back bit for bit and trains on."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from engine.cli import app
from engine.launcher import RankFailure, spawn
from tests.engine import hf_harness as h
from tests.engine.test_lora_peft import LLAMA, VOCAB
from tests.tools import require_module

peft = require_module("peft", "peft (a test dependency: pip install -e '.[dev]') is not installed")

RTOL = 1e-5
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]  # every HF projection


def lora_job(folder, ckpt, ranks: int = 1, **lora) -> dict:
    return h.job(
        folder, ranks,
        model={"lora": {"rank": 4, "alpha": 8, "target_modules": TARGETS, **lora}},
        training={"train_iters": 3},
        optimizer={"lr": 1e-2},
        checkpoint={"path": str(ckpt), "interval": 3},
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama, and a LoRA job on it trained 3 steps on TP=2 + SP (checkpoint at 3)."""
    root = tmp_path_factory.mktemp("lora-export")
    base = root / "base"
    base.mkdir()
    h.save_tiny(base, LlamaConfig, LlamaForCausalLM, **LLAMA)
    spec = lora_job(base, root / "ckpt", 2, dropout=0.1)
    spec["parallel"] = {"tensor": 2, "sequence_parallel": True}
    got = spawn(h.train_then_logits, 2, (spec, VOCAB), timeout_s=240)
    logits = next(r["logits"] for r in got if r["logits"] is not None)[..., :VOCAB]
    return base, root / "ckpt" / "hf", logits


def hf_logits(model) -> torch.Tensor:
    tokens, _ = h.batch(VOCAB, 2)
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits.float()


def close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_peft_loads_the_export_with_our_logits(trained, tmp_path):
    base, ckpt, ours = trained
    out = tmp_path / "adapter"
    result = CliRunner().invoke(app, ["export", str(ckpt), "--format", "peft", "--output", str(out), "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.1)
    assert config["base_model_name_or_path"] == str(base)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    model = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base, attn_implementation="eager"), out)
    theirs = hf_logits(model)
    assert close(ours, theirs) < RTOL
    assert close(hf_logits(LlamaForCausalLM.from_pretrained(base, attn_implementation="eager")), theirs) > 1e-3, (
        "the adapters changed the model"
    )


def test_merged_export_loads_in_transformers_with_our_logits(trained, tmp_path):
    _, ckpt, ours = trained
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", str(ckpt), "--merge-lora", "--output", str(out), "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    model = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert close(ours, hf_logits(model)) < RTOL


def test_lora_checkpoint_without_merge_and_bad_flags_exit_2(trained, tmp_path):
    _, ckpt, _ = trained
    runner = CliRunner()
    plain = runner.invoke(app, ["export", str(ckpt), "--output", str(tmp_path / "x")])
    assert plain.exit_code == 2 and "holds LoRA adapters only" in plain.output and "--format peft" in plain.output
    flags = runner.invoke(app, ["export", str(ckpt), "--format", "peft", "--merge-lora", "--output", str(tmp_path / "y")])
    assert flags.exit_code == 2 and "use it with --format hf" in flags.output


def test_full_checkpoint_has_no_adapters_to_export(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    h.save_tiny(base, LlamaConfig, LlamaForCausalLM, **LLAMA)
    spawn(h.import_save_step, 1, (h.job(base, 1, checkpoint={"path": str(tmp_path / "ckpt")}), VOCAB), timeout_s=240)
    runner = CliRunner()
    for flags in (["--format", "peft"], ["--merge-lora"]):
        bad = runner.invoke(app, ["export", str(tmp_path / "ckpt" / "hf"), *flags, "--output", str(tmp_path / "o")])
        assert bad.exit_code == 2 and "has no LoRA adapters" in bad.output, bad.output


def test_import_of_an_exported_adapter_continues_bit_for_bit(trained, tmp_path):
    """model.lora.init_from: the adapters come back exactly (fp32): the same logits on the same
    layout as a run that resumes the checkpoint itself, and the first step trains on."""
    base, ckpt, _ = trained
    out = tmp_path / "adapter"
    export_peft_folder = ["export", str(ckpt), "--format", "peft", "--output", str(out), "--dtype", "fp32"]
    assert CliRunner().invoke(app, export_peft_folder).exit_code == 0
    tp2 = {"tensor": 2, "sequence_parallel": True}
    imported = lora_job(base, tmp_path / "fresh", 2, init_from=str(out), dropout=0.1)
    imported["parallel"] = tp2
    resumed = lora_job(base, ckpt.parent, 2, dropout=0.1)
    resumed["parallel"] = tp2
    resumed["training"]["train_iters"] = 4
    got = spawn(h.import_save_step, 2, (imported, VOCAB), timeout_s=240)
    ref = spawn(h.train_then_logits, 2, (resumed, VOCAB, 3), timeout_s=240)  # resumes at 3: no step
    mine = next(r["logits"] for r in got if r["logits"] is not None)
    theirs = next(r["logits"] for r in ref if r["logits"] is not None)
    assert torch.equal(mine, theirs)
    assert got[0]["loss"] > 0
    wrong = lora_job(base, tmp_path / "wrong", 1, init_from=str(out), rank=8)
    with pytest.raises(RankFailure, match=r"adapter_config\.json has r 4, this job's is 8: set model\.lora to match"):
        spawn(h.import_save_step, 1, (wrong, VOCAB), timeout_s=240)
