"""`elastron train` and `elastron schema` as a user runs them: a real subprocess, real ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from engine.jobspec import json_schema
from tests.tiny_jobs import TINY_LLAMA

ELASTRON = [sys.executable, "-m", "elastron.cli"]
ROOT = Path(__file__).resolve().parents[2]

TINY_JOB = {
    "name": "cli-tiny",
    "model": {**TINY_LLAMA, "seq_length": 64},
    "parallel": {"tensor": 2, "sequence_parallel": True},
    "training": {"global_batch_size": 4, "micro_batch_size": 2, "train_iters": 12, "log_interval": 4},
    "optimizer": {"lr": 3e-3, "lr_warmup_iters": 2},
    "resources": {"ranks": 2, "device": "cpu"},
}


def run(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*ELASTRON, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_train_writes_a_metrics_line_per_iteration_and_loss_falls(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(TINY_JOB))
    metrics = tmp_path / "out" / "metrics.jsonl"
    proc = run("train", str(job), "--metrics-out", str(metrics))
    assert proc.returncode == 0, proc.stderr
    assert "tp=2" in proc.stdout and "iter    12/12" in proc.stdout, proc.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 13))
    for r in records:
        assert {"iteration", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s"} <= r.keys()
        assert r["tokens"] == 4 * 64 and r["tokens_per_s"] > 0
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]


def test_ranks_flag_overrides_the_job_and_is_validated(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(TINY_JOB))
    proc = run("train", str(job), "--ranks", "3")
    assert proc.returncode == 2
    assert "resources.ranks (3)" in proc.stderr and "parallel.tensor (2)" in proc.stderr, proc.stderr


def test_bad_job_exits_2_naming_the_field(tmp_path):
    bad = dict(
        TINY_JOB,
        model={**TINY_JOB["model"], "num_attention_heads": 6, "hidden_size": 96},
        parallel={"tensor": 4},
        resources={"ranks": 4},
    )
    job = tmp_path / "bad.yaml"
    job.write_text(yaml.safe_dump(bad))
    proc = run("train", str(job))
    assert proc.returncode == 2
    assert "model.num_attention_heads (6)" in proc.stderr and "parallel.tensor" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_key_is_an_error(tmp_path):
    job = tmp_path / "typo.yaml"
    job.write_text(yaml.safe_dump({**TINY_JOB, "parallel": {"tensor_paralel": 2}}))
    proc = run("train", str(job))
    assert proc.returncode == 2 and "tensor_paralel" in proc.stderr, proc.stderr


def test_feature_not_in_this_version_is_refused_before_start(tmp_path):
    job = tmp_path / "cp.yaml"
    spec = {**TINY_JOB, "parallel": {"tensor": 1, "context": 2}}
    spec["model"] = {**TINY_JOB["model"], "attention_dropout": 0.1}
    job.write_text(yaml.safe_dump(spec))
    proc = run("train", str(job))
    assert proc.returncode == 2 and "model.attention_dropout" in proc.stderr, proc.stderr


def test_missing_file_is_a_clear_error(tmp_path):
    proc = run("train", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "cannot read job file" in proc.stderr, proc.stderr


def test_schema_prints_the_job_schema():
    proc = run("schema")
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == json_schema()


def test_train_again_resumes_from_the_newest_checkpoint_and_appends_metrics(tmp_path):
    """`resume: auto` is the default: rerunning the job with more iterations continues it.

    Over 30 s on a loaded machine: two `elastron train` processes (~12-15 s each: their ranks
    import torch), as a user reruns a job."""
    spec = {
        **TINY_JOB,
        "training": {**TINY_JOB["training"], "train_iters": 4},
        "checkpoint": {"path": str(tmp_path / "ckpt"), "interval": 2},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    metrics = tmp_path / "metrics.jsonl"
    assert run("train", str(job), "--metrics-out", str(metrics)).returncode == 0
    assert sorted(p.name for p in (tmp_path / "ckpt" / "cli-tiny").iterdir()) == [
        "iter_0000002",
        "iter_0000004",
        "latest",
    ]
    spec["training"]["train_iters"] = 6
    job.write_text(yaml.safe_dump(spec))
    proc = run("train", str(job), "--metrics-out", str(metrics))
    assert proc.returncode == 0, proc.stderr
    assert "resumed at iteration 4" in proc.stdout, proc.stdout
    iterations = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()]
    assert iterations == [1, 2, 3, 4, 5, 6]
