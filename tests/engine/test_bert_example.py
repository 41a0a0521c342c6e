"""examples/bert_tiny.yaml as a user runs it: `elastron train` (fewer steps), the loss falls, and
the export (`elastron export --format hf`'s function) writes a BertForMaskedLM that transformers loads and that predicts
masked tokens of unseen samples far better than chance."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from transformers import BertForMaskedLM

from engine.data.builder import build_datasets
from engine.data.tokenizer import build_tokenizer
from engine.hf.exporter import export_hf
from engine.jobspec import load_job

ROOT = Path(__file__).resolve().parents[2]
ELASTRON = [sys.executable, "-m", "elastron.cli"]


def test_bert_example_trains_and_exports(tmp_path):
    """Over 30 s: two user processes in a row, `elastron train` (its ranks import torch) and
    `elastron export`, then transformers loads the export."""
    job = yaml.safe_load((ROOT / "examples/bert_tiny.yaml").read_text())
    job["training"].update(train_iters=10, log_interval=5)
    job["checkpoint"] = {"path": str(tmp_path / "ckpt")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    metrics = tmp_path / "metrics.jsonl"
    run = subprocess.run(
        [*ELASTRON, "train", str(tmp_path / "job.yaml"), "--metrics-out", str(metrics)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "bert 4L h128" in run.stdout and "tp=2" in run.stdout, run.stdout
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert losses[0] > math.log(261) - 0.3 and losses[-1] < losses[0] - 0.6, losses

    out = tmp_path / "hf"
    export_hf(str(tmp_path / "ckpt" / "bert-tiny"), str(out), dtype="fp32")  # `elastron export`'s function
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"] and config["max_position_embeddings"] == 128
    model = BertForMaskedLM.from_pretrained(out).eval()
    spec = load_job(tmp_path / "job.yaml")
    source = build_datasets(spec, build_tokenizer("byte"), 128, 99, synthetic_vocab_size=261).train
    batch = source.micro_batch(0, 0, 8, 1, 0)  # seed 99: samples training never drew
    with torch.no_grad():
        result = model(input_ids=batch.tokens, attention_mask=batch.inputs["attention_mask"], labels=batch.labels)
    assert float(result.loss) < losses[0] - 0.6, (float(result.loss), losses)
