"""Jobs on the shared two-node Ray cluster (conftest.py) that need its nodes:

- the rerun state machine's full path on real "other hardware": an injected persistent fault
  exits 16 on one node, the step re-runs on the other node, which tells a persistent error of
  the first (exit 17); the driver excludes that node and the job finishes without a human;
- elastic, launched as a Ray Job (`elastron worker-run`, as the control plane will): a node is
  removed under a 2-rank job, which goes on with 1 rank (data parallelism halved, the same global
  batch); the node comes back and the job grows to 2 ranks again; then `ray job stop` cancels it
  (SIGINT to the driver), and no Ray Train actor or placement group is left behind.
"""

from __future__ import annotations

import json
import os
import sys

from ray.job_submission import JobStatus, JobSubmissionClient

from engine.checkpointing.backends import open_storage
from engine.checkpointing.commit import committed_iterations, latest_checkpoint
from tests.environ import environment
from tests.ray_cluster import WORKER_NODE_ARGS, worker_nodes
from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import (
    kinds,
    ray_train_leftovers,
    run,
    seed_with_one_early_injection,
)


def test_persistent_fault_moves_to_other_hardware_excludes_the_node_and_finishes(
    ray_cluster, telemetry, tmp_path
):
    """Over 30 s: three attempts on Ray (the fault reproduced in place, re-run on other hardware,
    resumed away from the node)."""
    job_id = "move-1"
    spec = job(
        training={"seed": seed_with_one_early_injection(iterations=8), "train_iters": 8},
        resilience={"error_injection_rate": 4, "error_injection_type": "persistent_error", "max_restarts": 0},
        checkpoint={"path": str(tmp_path / "ckpt"), "interval": 4},
        resources={"ranks": 1},
    )
    result = run(job_id, spec, tmp_path / "runs")
    assert result.exit_code == 0, result.reason
    assert result.attempts == 3 and result.restarts_used == 0  # rerun restarts are not failures

    started = telemetry.events(job_id, "ranks_started")
    first, second, third = (e["nodes"][0] for e in started)
    assert second != first and third != first  # moved away from the suspect node, and kept away
    assert result.excluded_nodes == [first]
    elsewhere = telemetry.events(job_id, "rerun_elsewhere")
    assert [e["avoid_nodes"] for e in elsewhere] == [[first]]
    (excluded,) = telemetry.events(job_id, "node_excluded")
    assert excluded["nodes"] == [first] and excluded["diagnosis"] == "persistent_error"
    (diagnosis,) = [e for e in telemetry.events(job_id, "diagnosis") if e["diagnosis"] == "persistent_error"]
    assert diagnosis["suspects"] == f"{first}/cpu" and diagnosis["host"] == second
    exits = [(e["exit_code"], e["host"]) for e in telemetry.events(job_id, "exit")]
    assert exits == [(16, first), (17, second)]
    records = telemetry.final_records(job_id)
    assert list(records) == list(range(1, 9)) and records[8]["attempt"] == 2
    assert kinds(telemetry, job_id)[-1] == "job_succeeded"


def test_elastic_job_shrinks_when_a_node_goes_and_grows_back_then_cancels(ray_cluster, telemetry, tmp_path):
    """Over 30 s: a node removed and added back: three Ray worker group starts, the last one cancelled."""
    c = ray_cluster
    job_id = "elastic-1"
    spec = job(
        training={"train_iters": 100000},
        resilience={"max_restarts": 2},
        checkpoint={"path": str(tmp_path / "ckpt"), "interval": 5},
        resources={"ranks": 2, "min_ranks": 1, "max_ranks": 2},
    )
    # Launched the way the control plane launches it: a Ray Job running `elastron worker-run`,
    # the spec and the telemetry settings in the job's environment (its ranks inherit it).
    with environment(RAY_AUTH_MODE="token"):  # Ray 2.60's token auth, for the client
        client = JobSubmissionClient(f"http://{c.webui_url}")
    env = {k: os.environ[k] for k in os.environ if k.startswith(("ELASTRON_", "RAY_TRAIN_"))}
    client.submit_job(
        entrypoint=f"{sys.executable} -m elastron.cli worker-run {job_id} --storage {tmp_path / 'runs'}",
        submission_id=job_id,
        runtime_env={
            "env_vars": {**env, "ELASTRON_JOB_SPEC": json.dumps(spec), "ELASTRON_RESIZE_INTERVAL_S": "2"}
        },
    )

    def started(world: int) -> list[dict]:
        return [e for e in telemetry.events(job_id, "ranks_started") if e["world_size"] == world]

    def records_after(event: dict) -> list[dict]:
        return [r for r in telemetry.records(job_id) if r["ts"] > event["ts"]]

    def alive(what: str):
        def check():
            status = client.get_job_status(job_id)
            assert not status.is_terminal(), (
                f"the job ended ({status}) before {what}:\n{client.get_job_logs(job_id)}"
            )
            return True

        return check

    try:
        wait_for(lambda: alive("training")() and len(telemetry.records(job_id)) >= 7, what="7 iterations")
        (full,) = started(2)
        victim = next(r["node_id"] for r in full["ranks"] if r["rank"] == 1)
        c.remove_node(next(n for n in worker_nodes(c) if n.node_id == victim), allow_graceful=False)

        shrunk = wait_for(lambda: alive("shrinking")() and started(1), what="the job on 1 rank")[0]
        small = wait_for(
            lambda: len(records_after(shrunk)) >= 3 and records_after(shrunk), what="1-rank steps"
        )
        c.add_node(**WORKER_NODE_ARGS)  # the node comes back

        regrown = wait_for(lambda: alive("growing")() and started(2)[1:], what="the job on 2 ranks again")[0]
        wait_for(lambda: len(records_after(regrown)) >= 3, what="2-rank steps after growing back")
        client.stop_job(job_id)  # SIGINT to the driver (RAY_JOB_STOP_SIGNAL on the head)
        status = wait_for(
            lambda: (st := client.get_job_status(job_id)).is_terminal() and st, 120, "the job to stop"
        )
    finally:
        if not client.get_job_status(job_id).is_terminal():
            client.stop_job(job_id)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.STOPPED, logs
    assert "error: cancelled" in logs  # worker-run exited 130 through its own path

    assert full["group"] < shrunk["group"] < regrown["group"]
    assert {(r["world_size"], r["data_parallel_size"]) for r in small} == {(1, 1)}
    grown = records_after(regrown)
    assert {(r["world_size"], r["data_parallel_size"]) for r in grown} == {(2, 2)}
    assert {r["global_batch_size"] for r in telemetry.records(job_id)} == {4}  # the same global batch
    # Each (re)start resumed from a checkpoint (every 5 iterations) the group before had reached.
    # (On a machine this loaded a group killed by Ray may not get its last record out, so the
    # checkpoint may be one interval past the last record that arrived.)
    for event in (shrunk, regrown):
        before = [r["iteration"] for r in telemetry.records(job_id) if r["ts"] < event["ts"]]
        resumed = records_after(event)[0]["iteration"] - 1
        assert resumed % 5 == 0 and 5 <= resumed <= max(before) + 5

    (failure,) = telemetry.events(job_id, "attempt_failed")  # the node loss; the growth is no failure
    assert failure["causes"][0]["kind"] == "died" and failure["causes"][0]["node_id"] == victim, failure[
        "causes"
    ]
    assert kinds(telemetry, job_id)[-1] == "job_cancelled"
    assert wait_for(lambda: ray_train_leftovers(c) == {"actors": [], "placement_groups": []} or None, 60, "cleanup")
    # Whatever save was in flight was committed or abandoned: the newest checkpoint is a committed one.
    storage = open_storage(str(tmp_path / "ckpt" / job_id))
    assert latest_checkpoint(storage, "rayjob") in committed_iterations(storage, "rayjob")
