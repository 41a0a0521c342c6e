"""Jobs on the shared Ray cluster (conftest.py: two one-CPU nodes, real processes):

- a 2-rank job trains to the same losses as `elastron train` on the same spec, an injected
  transient fault (re-run in place) included;
- one rank killed with SIGKILL mid-run (its pid from the rank's own report), then one frozen with
  SIGSTOP (a collective that never returns; the step watchdog fails its peer): each time the job
  resumes from the last committed checkpoint, and it ends on the uninterrupted run's losses;
- a failure with no restart left: the job fails with each rank's cause;
- an injected persistent fault: the engine exits 16 to re-run the step on other hardware, and the
  2-rank job already fills every node there is, so the job fails with 16 and says so (what a
  one-node cluster does; test_ray_elastic.py moves a 1-rank job to the other node instead).

A cancel through `elastron worker-run` (SIGINT) is tested with the elastic job in
test_ray_elastic.py, which needs a driver in its own process anyway.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from engine.checkpointing.backends import open_storage
from engine.checkpointing.commit import latest_checkpoint
from tests.waiting import wait_for
from tests.workers.conftest import JOB, job
from tests.workers.ray_helpers import (
    elastron_train,
    kinds,
    run,
    seed_with_one_early_injection,
)

LOSS_RTOL = 1e-5
ITERS = JOB["training"]["train_iters"]
TRANSIENT = {"error_injection_rate": 4, "error_injection_type": "transient_error", "max_restarts": 1}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`elastron train` (no Ray) on the spec the Ray jobs below run: the losses to match."""
    workdir = tmp_path_factory.mktemp("reference")
    spec = job(resilience=TRANSIENT, checkpoint={"path": str(workdir / "ckpt")})
    return {r["iteration"]: r["loss"] for r in elastron_train(spec, workdir)}


def losses(telemetry, job_id: str) -> dict[int, float]:
    return {it: r["loss"] for it, r in telemetry.final_records(job_id).items()}


def test_job_trains_like_elastron_train_and_a_transient_fault_continues_in_place(
    ray_cluster, telemetry, reference, tmp_path
):
    spec = job(resilience=TRANSIENT, checkpoint={"path": str(tmp_path / "ckpt")})
    result = run("done-1", spec, tmp_path / "runs")
    assert result.exit_code == 0, result.reason
    assert result.attempts == 1 and result.restarts_used == 0

    got = losses(telemetry, "done-1")
    assert list(got) == list(range(1, ITERS + 1))
    assert list(got.values()) == pytest.approx(list(reference.values()), rel=LOSS_RTOL)
    assert result.last["iteration"] == ITERS
    assert result.last["loss"] == pytest.approx(reference[ITERS], rel=LOSS_RTOL)
    record = telemetry.final_records("done-1")[ITERS]
    assert (record["world_size"], record["data_parallel_size"], record["attempt"], record["group"]) == (
        2,
        2,
        0,
        0,
    )

    # The transient faults: re-run in place, diagnosed, and the run went on (no restart).
    transient = [e for e in telemetry.events("done-1", "diagnosis") if e["diagnosis"] == "transient_error"]
    assert transient and {e["source"] for e in transient} == {"rank-0", "rank-1"}
    assert record["rerun"]["transient_errors"] >= 1
    assert kinds(telemetry, "done-1") == ["job_started", "attempt_started", "job_succeeded"]
    (started,) = telemetry.events("done-1", "ranks_started")
    assert started["world_size"] == 2 and len({r["pid"] for r in started["ranks"]}) == 2


def test_a_killed_rank_and_then_a_hung_rank_both_resume_from_the_last_checkpoint(
    ray_cluster, telemetry, reference, tmp_path
):
    """Attempt 0: rank 1 is killed with SIGKILL. Attempt 1: rank 1 is frozen with SIGSTOP, so
    rank 0 waits in a collective that never returns, until its step watchdog fails it. Each
    time the job restarts from the newest committed checkpoint; it ends on the uninterrupted
    run's losses.

    Over 30 s: three attempts on Ray, the second one waited out by its 10 s step watchdog (the hang
    under test)."""
    job_id = "kill-1"
    spec = job(
        resilience={**TRANSIENT, "max_restarts": 2, "step_timeout_s": 10},
        checkpoint={"path": str(tmp_path / "ckpt")},
    )
    done: dict = {}

    def rank_1(attempt: int) -> dict:
        # The pid comes from the rank itself (its ranks_started report), not from a process name.
        started = wait_for(
            lambda: [e for e in telemetry.events(job_id, "ranks_started") if e["attempt"] == attempt],
            what=f"attempt {attempt} started",
        )
        return next(r for r in started[0]["ranks"] if r["rank"] == 1)

    def records(attempt: int) -> list[int]:
        return [r["iteration"] for r in telemetry.records(job_id) if r["attempt"] == attempt]

    def interfere():
        victim = rank_1(0)
        # Mid-run: after the checkpoint at iteration 5 is committed (records come after saves).
        wait_for(lambda: any(i >= 7 for i in records(0)), what="iteration 7")
        os.kill(victim["pid"], signal.SIGKILL)
        done["killed"] = victim["pid"]
        frozen = rank_1(1)
        wait_for(lambda: len(records(1)) >= 2, what="attempt 1 training")
        os.kill(frozen["pid"], signal.SIGSTOP)  # Ray's shutdown SIGKILLs it later
        done["frozen"] = frozen["pid"]

    helper = threading.Thread(target=interfere, daemon=True)
    helper.start()
    result = run(job_id, spec, tmp_path / "runs")
    helper.join(timeout=60)
    assert done.get("killed") and done.get("frozen"), "the ranks were not interfered with"
    assert result.exit_code == 0, result.reason
    assert result.attempts == 3 and result.restarts_used == 2

    killed, hung = telemetry.events(job_id, "attempt_failed")
    root = killed["causes"][0]
    assert (root["rank"], root["kind"], root["pid"]) == (1, "died", done["killed"])
    root = hung["causes"][0]
    assert (root["rank"], root["kind"]) == (0, "watchdog")
    assert "made no progress" in root["message"] and "phase '" in root["message"]
    assert [e["group"] for e in telemetry.events(job_id, "ranks_started")] == [0, 1, 2]
    (dog,) = telemetry.events(job_id, "watchdog_timeout")
    assert dog["source"] == "rank-0" and dog["attempt"] == 1

    for attempt in (1, 2):  # each resumed from a checkpoint its predecessor had committed
        resumed_from = records(attempt)[0] - 1
        # Rank 0 sends a step's record after that step's save; it is delivered even when the
        # group is torn down right after (workers.rank.on_worker_shutdown flushes every rank).
        assert resumed_from % 5 == 0 and 5 <= resumed_from <= max(records(attempt - 1))
    assert records(2) == list(range(records(2)[0], ITERS + 1))
    got = losses(telemetry, job_id)
    assert list(got.values()) == pytest.approx(list(reference.values()), rel=LOSS_RTOL)


def test_restart_budget_spent_fails_the_job_with_the_cause(ray_cluster, telemetry, tmp_path):
    # (Counted restarts that succeed: the SIGKILL/SIGSTOP test above; the counting: test_policy.)
    missing = tmp_path / "no-such-corpus.txt"
    spec = job(
        data={"source": "text", "path": str(missing)},
        resilience={"max_restarts": 0},
        checkpoint={"path": str(tmp_path / "ckpt")},
    )
    result = run("budget-1", spec, tmp_path / "runs")
    assert result.exit_code == 1 and result.attempts == 1 and result.restarts_used == 1
    assert "max_restarts = 0" in result.reason and f"no such file {missing}" in result.reason
    (failure,) = telemetry.events("budget-1", "attempt_failed")
    assert {c["rank"] for c in failure["causes"]} == {0, 1}
    assert all("FileNotFoundError" in c["message"] for c in failure["causes"])
    assert kinds(telemetry, "budget-1") == ["job_started", "attempt_started", "attempt_failed", "job_failed"]


def test_a_persistent_fault_fails_with_16_when_there_is_no_other_hardware(ray_cluster, telemetry, tmp_path):
    spec = job(
        training={"seed": seed_with_one_early_injection(iterations=ITERS, only=False)},
        resilience={"error_injection_rate": 4, "error_injection_type": "persistent_error", "max_restarts": 3},
        checkpoint={"path": str(tmp_path / "ckpt")},
    )
    result = run("persist-1", spec, tmp_path / "runs")
    assert result.exit_code == 16 and result.attempts == 1 and result.restarts_used == 0
    assert "cannot be checked on other hardware" in result.reason
    (engine_exit,) = [e for e in telemetry.events("persist-1", "exit") if e["source"] == "rank-0"]
    assert engine_exit["exit_code"] == 16
    assert kinds(telemetry, "persist-1")[-2:] == ["rerun_elsewhere_impossible", "job_failed"]
    # The checkpoint to re-run from is committed, for when the job is resubmitted to a bigger cluster.
    storage = open_storage(str(tmp_path / "ckpt" / "persist-1"))
    assert latest_checkpoint(storage, "rayjob") is not None
