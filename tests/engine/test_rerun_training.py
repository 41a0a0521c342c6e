"""The rerun state machine inside real training on 2 CPU ranks (data parallel), end to end:

- injected errors through `elastron train` as a user runs it: exit codes 16/17 and the event
  record, a "move" to other hardware simulated with ELASTRON_NODE_ID;
- a real NaN (one poisoned sample on one rank, no injection): caught, reproduced in place
  (exit 16), reproduced again after the move (exit 17, correct result: the data is at fault),
  and with skip_bad_batches the job goes on past that batch.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from engine import parallel_state as ps
from engine.data.sources import TokenSource
from engine.jobspec import JobSpec
from engine.launcher import RankFailure, spawn
from engine.rerun.state_machine import Diagnosis, ErrorInjector
from engine.train_loop import train_rank
from engine.training import Trainer
from tests.tiny_jobs import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[2]
ELASTRON = [sys.executable, "-m", "elastron.cli"]

JOB = {
    "name": "rerun",
    "model": dict(TINY_LLAMA),
    "data": {"source": "text"},
    "training": {
        "global_batch_size": 4,
        "micro_batch_size": 2,
        "train_iters": 6,
        "seed": 11,
        "log_interval": 3,
    },
    "optimizer": {"lr": 2e-3, "lr_warmup_iters": 1},
    "checkpoint": {"interval": 2},
    "resources": {"ranks": 2, "device": "cpu"},
}
DRAWS_PER_ITERATION = 2  # fp32: the loss and the grad norm are validated every iteration


def make_job(tmp_path: Path, **resilience) -> dict:
    job = copy.deepcopy(JOB)
    job["checkpoint"]["path"] = str(tmp_path / "ckpt")
    job["resilience"] = resilience
    return job


def train_cli(
    tmp_path: Path, job: dict, node: str = "node-a", out: str = "out"
) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {**os.environ, "ELASTRON_NODE_ID": node}
    metrics = tmp_path / out / "metrics.jsonl"
    args = [
        "train",
        str(path),
        "--quiet",
        "--metrics-out",
        str(metrics),
        "--events-out",
        str(tmp_path / "events.jsonl"),
    ]
    return subprocess.run([*ELASTRON, *args], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def seed_with_one_early_injection(rate: int, iterations: int) -> tuple[int, int]:
    """A training seed whose injection schedule rejects once, in iteration 2 or 3, and never
    again in the run (so each test sees exactly one suspicious iteration); and that iteration."""
    horizon = DRAWS_PER_ITERATION * (iterations + 1)
    for seed in range(1000):
        inj = ErrorInjector(rate, Diagnosis.TRANSIENT_ERROR, seed)
        hits = [d for d in range(1, horizon + 1) if inj.maybe_inject()]
        if len(hits) == 1 and DRAWS_PER_ITERATION < hits[0] <= 3 * DRAWS_PER_ITERATION:
            return seed, (hits[0] - 1) // DRAWS_PER_ITERATION + 1
    raise AssertionError("no seed found")


def train_spawned(tmp_path: Path, job: dict, node: str = "node-a") -> int:
    """The same run as `elastron train`, on ranks spawned from this process (no interpreter
    start-up); returns the exit code the CLI would have exited with."""
    metrics, events = tmp_path / "out" / "metrics.jsonl", tmp_path / "events.jsonl"
    try:
        spawn(
            train_rank,
            2,
            (job, str(metrics), True, str(events)),
            env={"ELASTRON_NODE_ID": node},
            timeout_s=240,
        )
    except RankFailure as err:
        agreed = err.agreed_exit()
        return agreed[0] if agreed else 1
    return 0


def test_transient_injection_continues_and_ends_on_the_clean_runs_loss(tmp_path):
    seed, bad_iteration = seed_with_one_early_injection(rate=4, iterations=6)
    clean = make_job(tmp_path / "clean")
    clean["training"]["seed"] = seed
    assert train_spawned(tmp_path / "clean", clean) == 0
    injected = make_job(tmp_path, error_injection_rate=4, error_injection_type="transient_error")
    injected["training"]["seed"] = seed
    assert train_spawned(tmp_path, injected) == 0

    events = read_jsonl(tmp_path / "events.jsonl")
    saved = [e for e in events if e["kind"] == "checkpoint_saved"]
    assert [e["iteration"] for e in saved] == [2, 4, 6] and all(e["rank"] == 0 for e in saved)
    assert all(e["bytes"] > 100_000 and e["seconds"] > 0 for e in saved)
    assert saved[0]["uri"] == f"{tmp_path / 'ckpt'}/rerun/iter_0000002"
    diagnoses = [e for e in events if e["kind"] == "diagnosis"]
    assert {e["rank"] for e in diagnoses} == {0, 1}
    assert {(e["iteration"], e["diagnosis"]) for e in diagnoses} == {(bad_iteration, "transient_error")}
    assert all(e["host"] == "node-a" and e["device"] == "cpu" for e in events)
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    clean_records = read_jsonl(tmp_path / "clean" / "out" / "metrics.jsonl")
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in clean_records], rel=1e-6)
    assert records[-1]["rerun"]["transient_errors"] == 1 and records[-1]["rerun"]["reruns"] == 1


def test_persistent_error_injection_through_the_cli_exits_16_then_17_then_resumes(tmp_path):
    """Over 30 s: three `elastron train` processes in a row (exit 16, exit 17, then the resume), as a
    user's would run."""
    seed, bad_iteration = seed_with_one_early_injection(rate=4, iterations=6)
    job = make_job(tmp_path, error_injection_rate=4, error_injection_type="persistent_error")
    job["training"]["seed"] = seed

    first = train_cli(tmp_path, job, node="node-a")
    assert first.returncode == 16, first.stderr
    assert "resume from the checkpoint on other hardware" in first.stderr
    moved = train_cli(tmp_path, job, node="node-b")
    assert moved.returncode == 17, moved.stderr
    assert "persistent error of the first device (node-a/cpu)" in moved.stderr
    # Resumed on healthy hardware, the job trains to the end from the suspect iteration on.
    done = train_cli(tmp_path, job, node="node-b", out="resumed")
    assert done.returncode == 0, done.stderr
    records = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert records[0]["iteration"] == bad_iteration and records[-1]["iteration"] == 6

    events = read_jsonl(tmp_path / "events.jsonl")
    exits = [(e["host"], e["exit_code"], e["diagnosis"]) for e in events if e["kind"] == "exit"]
    assert exits == [("node-a", 16, None), ("node-b", 17, "persistent_error")]
    diagnosis = next(e for e in events if e["kind"] == "diagnosis")
    assert diagnosis["suspects"] == "node-a/cpu" and diagnosis["host"] == "node-b"


def test_correct_result_injection_exits_16_until_moved_then_17(tmp_path):
    seed, bad_iteration = seed_with_one_early_injection(rate=4, iterations=6)
    job = make_job(tmp_path, error_injection_rate=4, error_injection_type="correct_result")
    job["training"]["seed"] = seed
    assert train_spawned(tmp_path, job, node="node-a") == 16
    assert train_spawned(tmp_path, job, node="node-a") == 16  # put back on the suspect device
    assert train_spawned(tmp_path, job, node="node-b") == 17
    events = read_jsonl(tmp_path / "events.jsonl")
    exits = [(e["host"], e["exit_code"], e["diagnosis"]) for e in events if e["kind"] == "exit"]
    assert exits == [("node-a", 16, None), ("node-a", 16, None), ("node-b", 17, "correct_result")]
    assert {e["iteration"] for e in events if not e["kind"].startswith("checkpoint")} == {bad_iteration}


# ---------------------------------------------------------------- a real NaN from the data


class PoisonedSource(TokenSource):
    """Sample `bad` becomes a sequence of `token`, whose embedding row is NaN: a data fault."""

    def __init__(self, inner, bad: int, token: int):
        self.inner, self.bad, self.token = inner, bad, token

    def __getitem__(self, index: int) -> torch.Tensor:
        sample = self.inner[index]
        return torch.full_like(sample, self.token) if index == self.bad else sample


def poisoned_rank(job: dict, events: str, bad_sample: int) -> dict:
    trainer = Trainer(JobSpec.model_validate(job), events_path=events)
    token = trainer.config.padded_vocab_size - 1  # padding row: no real text ever uses it
    with torch.no_grad():
        trainer.model.embedding.weight[token] = float("nan")
    trainer.source = PoisonedSource(trainer.source, bad_sample, token)
    losses = {}
    try:
        while trainer.iteration < trainer.spec.training.train_iters:
            m = trainer.train_step()
            if m is not None:
                losses[m.iteration] = m.loss
                trainer.save_checkpoint_if_due()
        trainer.checkpointer.wait()
    finally:
        ps.destroy_model_parallel()
    return {"losses": losses, "consumed": trainer.consumed_samples, "summary": trainer.rerun.summary()}


def run_poisoned(tmp_path: Path, job: dict, node: str) -> list[dict]:
    return spawn(
        poisoned_rank,
        2,
        (job, str(tmp_path / "events.jsonl"), 9),  # sample 9: iteration 3, DP rank 0 only
        env={"ELASTRON_NODE_ID": node},
        timeout_s=240,
    )


def test_nan_from_a_poisoned_sample_is_diagnosed_correct_result_and_skipped_when_allowed(tmp_path):
    job = make_job(tmp_path)
    with pytest.raises(RankFailure) as caught:
        run_poisoned(tmp_path, job, "node-a")
    assert caught.value.agreed_exit()[0] == 16
    with pytest.raises(RankFailure) as caught:
        run_poisoned(tmp_path, job, "node-b")
    assert caught.value.agreed_exit()[0] == 17
    assert "the data or the code produces it" in str(caught.value)

    events = read_jsonl(tmp_path / "events.jsonl")
    rejected = [e for e in events if e["kind"] == "result_rejected"]
    # Rank 0 holds the poisoned sample: its loss is NaN. Rank 1's loss is fine, but the grad
    # norm is global (reduced over DP), so it rejects that; both go through the diagnosis.
    assert sorted((e["rank"], e["iteration"], e["message"], e["injected"]) for e in rejected) == [
        (0, 3, "loss is NaN or Inf", False),
        (1, 3, "grad norm is NaN or Inf", False),
    ]
    assert all(e["result"] != e["result"] for e in rejected)  # NaN
    assert [e["diagnosis"] for e in events if e["kind"] == "diagnosis"] == ["correct_result"]

    job["resilience"] = {"skip_bad_batches": True}
    out = run_poisoned(tmp_path, job, "node-b")[0]
    assert sorted(out["losses"]) == [3, 4, 5, 6]  # iteration 3 is redone on the next batch
    assert out["consumed"] == (6 + 1) * 4  # one global batch skipped
    assert out["summary"]["skipped_batches"] == 1
    assert all(v == v for v in out["losses"].values())  # no NaN trained on
    kinds = [
        e["kind"] for e in read_jsonl(tmp_path / "events.jsonl") if not e["kind"].startswith("checkpoint")
    ]
    assert kinds[-1] == "batch_skipped"
