"""`elastron train examples/t5_tiny.yaml` as a user runs it (a real subprocess, two ranks with
TP=2 + SP), with fewer steps: it trains, and the span-corruption loss falls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from engine.jobspec import load_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "t5_tiny.yaml"


def test_example_validates():
    spec = load_job(EXAMPLE)
    assert spec.model.arch == "t5" and spec.data.source == "span_corruption"
    assert spec.model.tie_embeddings and spec.model.t5.scale_decoder_outputs
    assert spec.parallel.tensor == 2 and spec.parallel.sequence_parallel


def test_example_trains(tmp_path):
    job = yaml.safe_load(EXAMPLE.read_text())
    job["training"].update(train_iters=16, log_interval=8)
    job["optimizer"]["lr_warmup_iters"] = 2
    job["resources"]["device"] = "cpu"
    path = tmp_path / "t5.yaml"
    path.write_text(yaml.safe_dump(job))
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "elastron.cli", "train", str(path), "--metrics-out", str(metrics)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 16 and losses[-1] < losses[0] - 0.15, losses[::5] + losses[-1:]
