"""In-memory checkpoints on the shared 2-node cluster (conftest.py: two one-CPU worker nodes, so
the 2-rank job has one rank per node and each rank's replica lives on the other node).

- a rank killed with SIGKILL: the group resumes from the snapshots in its nodes' holders
  (`recovered_from: memory`), losing at most one step;
- a node removed (rank 1 and its node's holder gone; a fresh node added): the group resumes from
  the replicas on the surviving node (`recovered_from: replica`);
- both holders of the snapshots gone as well: the group falls back to the newest persistent
  checkpoint (`recovered_from: persistent`);

and each time the job ends on the uninterrupted run's losses (`elastron train`, no Ray).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.waiting import wait_for
from tests.workers.conftest import job, worker_nodes
from tests.workers.ray_helpers import elastron_train, run

LOSS_RTOL = 1e-5
ITERS = 16
INTERVAL = 4  # persistent


def _spec(tmp_path) -> dict:
    return job(
        training={"train_iters": ITERS, "log_interval": 4},
        checkpoint={"path": str(tmp_path / "ckpt"), "interval": INTERVAL, "local_interval": 1},
        resilience={"max_restarts": 1},
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    return {r["iteration"]: r["loss"] for r in elastron_train(_spec(workdir), workdir)}


def _kill_rank_1_mid_run(telemetry, job_id: str, at: int, before_kill=None) -> dict:
    done: dict = {}

    def interfere():
        started = wait_for(lambda: telemetry.events(job_id, "ranks_started"), what="ranks started")
        victim = next(r for r in started[0]["ranks"] if r["rank"] == 1)
        wait_for(lambda: any(r["iteration"] >= at for r in telemetry.records(job_id)), what=f"iteration {at}")
        if before_kill is not None:
            before_kill()
        os.kill(victim["pid"], signal.SIGKILL)
        done["killed"] = victim["pid"]

    threading.Thread(target=interfere, daemon=True).start()
    return done


def _check_final_losses(telemetry, job_id: str, reference: dict) -> None:
    got = {it: r["loss"] for it, r in telemetry.final_records(job_id).items()}
    assert list(got) == list(range(1, ITERS + 1))
    assert list(got.values()) == pytest.approx(list(reference.values()), rel=LOSS_RTOL)


def test_a_killed_rank_resumes_from_memory_losing_at_most_one_step(
    ray_cluster, telemetry, reference, tmp_path
):
    job_id = "mem-kill"
    done = _kill_rank_1_mid_run(telemetry, job_id, at=9)
    result = run(job_id, _spec(tmp_path), tmp_path / "runs")
    assert done.get("killed"), "rank 1 was not killed"
    assert result.exit_code == 0, result.reason
    assert result.attempts == 2
    (recovered,) = telemetry.events(job_id, "recovered")
    assert recovered["recovered_from"] == "memory", recovered
    assert recovered["iteration"] > 8  # newer than the persistent checkpoint of iteration 8
    assert recovered["steps_lost"] is not None and recovered["steps_lost"] <= 1, recovered
    assert set(recovered["phase_seconds"]) >= {
        "group_start",
        "imports",
        "build_and_persistent_resume",
        "restore",
    }
    first_after = min(r["iteration"] for r in telemetry.records(job_id) if r["attempt"] == 1)
    assert first_after == recovered["iteration"] + 1
    _check_final_losses(telemetry, job_id, reference)


def test_without_any_holder_the_group_falls_back_to_the_persistent_checkpoint(
    ray_cluster, telemetry, reference, tmp_path
):
    from workers.snapshots import existing_holders, kill_holders

    job_id = "mem-lost"

    def kill_every_holder():
        assert len(existing_holders(job_id)) == 2  # one per node: own copies and replicas
        kill_holders(job_id)

    done = _kill_rank_1_mid_run(telemetry, job_id, at=10, before_kill=kill_every_holder)
    result = run(job_id, _spec(tmp_path), tmp_path / "runs")
    assert done.get("killed"), "rank 1 was not killed"
    assert result.exit_code == 0, result.reason
    (recovered,) = telemetry.events(job_id, "recovered")
    assert recovered["recovered_from"] == "persistent", recovered
    assert recovered["iteration"] % INTERVAL == 0 and recovered["iteration"] >= 8
    _check_final_losses(telemetry, job_id, reference)


def test_a_lost_node_resumes_from_the_replica_on_the_other_node(ray_cluster, telemetry, reference, tmp_path):
    job_id = "mem-node"
    outcome: dict = {}
    # The driver runs in a thread: Ray starts and stops nodes from the main thread only.
    driver = threading.Thread(
        target=lambda: outcome.update(result=run(job_id, _spec(tmp_path), tmp_path / "runs")), daemon=True
    )
    driver.start()
    started = wait_for(lambda: telemetry.events(job_id, "ranks_started"), what="ranks started")
    victim = next(r for r in started[0]["ranks"] if r["rank"] == 1)
    survivor = next(r for r in started[0]["ranks"] if r["rank"] == 0)

    def replica_of_rank_1() -> int:
        """The newest step of rank 1 the surviving node's holder has (pushes are asynchronous:
        a record can be a step ahead of the replica)."""
        import ray

        from workers.snapshots import existing_holders

        h = existing_holders(job_id).get(survivor["node_id"])
        return max(ray.get(h.stats.remote())["ranks"].get(1, [0]), default=0) if h is not None else 0

    wait_for(lambda: replica_of_rank_1() >= 9, what="rank 1's replica of iteration 9")
    node = next(n for n in worker_nodes(ray_cluster) if n.node_id == victim["node_id"])
    ray_cluster.remove_node(node, allow_graceful=False)
    ray_cluster.add_node(num_cpus=1)  # a fresh node (no snapshots) for the restarted rank
    driver.join(timeout=300)
    result = outcome.get("result")
    assert result is not None and result.exit_code == 0, result
    (recovered,) = telemetry.events(job_id, "recovered")
    assert recovered["recovered_from"] == "replica", recovered
    assert recovered["iteration"] > 8 and recovered["steps_lost"] <= 1, recovered
    _check_final_losses(telemetry, job_id, reference)
