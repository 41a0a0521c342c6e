"""resilience.on_rank_failure: replace_replica through what else happens to a job on Ray (the
shared cluster, plus one spare node this test adds and then removes):

1. the node of replica 1 is lost: Ray places its replacement on the spare node, where it heals
   from replica 0, which kept stepping;
2. both replicas die at once (no live peer to heal from): the job falls back to the newest
   persistent checkpoint, as restart_group would, and trains on;
3. the scheduler's stop (a preemption, or a resize's stop) arrives while replica 1 is being
   replaced: the survivor stops at a step boundary with a checkpoint of that step, and the
   replacement, which has nobody left to join, exits instead of waiting for its peers: the run
   ends in seconds;
4. the next launch resumes from exactly that step and finishes the job (its train_iters a few
   steps past the stop: the first launch has no end of its own).
"""

from __future__ import annotations

import os
import signal
import threading
import time

from tests.ray_cluster import WORKER_NODE_ARGS, worker_nodes
from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import run

# The first launch runs until the stop ends it; the relaunch trains this many steps past the stop.
OPEN_ENDED = 100_000
AFTER_STOP = 30
INTERVAL = 20  # checkpoint.interval


def _spec(tmp_path, iters: int) -> dict:
    return job(
        training={"train_iters": iters, "log_interval": 40},
        checkpoint={"path": str(tmp_path / "ckpt"), "interval": INTERVAL},
        resilience={"on_rank_failure": "replace_replica", "max_restarts": 8, "warm_restart": True},
    )


def _started(telemetry, job_id: str, replica: int, after: float = 0.0) -> list[dict]:
    """replica_started events of `replica` after `after`, oldest first: each its rank's pid and node."""
    return [
        e["ranks"][0]
        for e in telemetry.events(job_id, "replica_started")
        if e["replica"] == replica and e["ts"] > after
    ]


def _reached(telemetry, job_id: str) -> int:
    return max((r["iteration"] for r in telemetry.records(job_id)), default=0)


def test_replicas_through_a_lost_node_a_double_failure_and_a_preemption(ray_cluster, telemetry, tmp_path):
    """Over 30 s: a lost node, a double failure and a preemption, each followed by new Ray worker
    groups for the replicas."""
    c = ray_cluster
    job_id = "ft-lifecycle"
    spare = c.add_node(**WORKER_NODE_ARGS)
    c.wait_for_nodes()
    seen: dict = {}

    def interfere():
        try:
            first = wait_for(lambda: _started(telemetry, job_id, 1), 120, "replica 1 started")[0]
            wait_for(lambda: _reached(telemetry, job_id) >= 30, 120, "iteration 30")
            # 1. Replica 1's node is lost; the replacement can only go to the node left free.
            lost_at = seen["lost_at"] = time.time()
            node = next(n for n in worker_nodes(c) if n.node_id == first["node_id"])
            c.remove_node(node, allow_graceful=False)
            seen["lost_node"] = first["node_id"]
            seen["moved"] = wait_for(lambda: _started(telemetry, job_id, 1, lost_at), 120, "replica 1 replaced")[0]
            seen["moved_at"] = time.time()
            wait_for(
                lambda: [e for e in telemetry.events(job_id, "replica_rejoined") if e["ts"] > lost_at and "heal_s" in e],
                120,
                "replica 1 healed on another node",
            )
            # 2. Both replicas at once: nobody to heal from.
            wait_for(lambda: _reached(telemetry, job_id) >= 90, 120, "iteration 90")
            both_at = time.time()
            pids = [_started(telemetry, job_id, i)[-1]["pid"] for i in (0, 1)]
            seen["both_killed_after"] = _reached(telemetry, job_id)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            for i in (0, 1):
                wait_for(lambda i=i: _started(telemetry, job_id, i, both_at), 120, f"replica {i} restarted")
            seen["both_at"], seen["both_back_at"] = both_at, time.time()
            # 3. A stop while replica 1 is being replaced.
            wait_for(
                lambda: any(r["ts"] > both_at and r["iteration"] >= 150 for r in telemetry.records(job_id)),
                120,
                "iteration 150 after the double failure",
            )
            os.kill(_started(telemetry, job_id, 1)[-1]["pid"], signal.SIGKILL)
            telemetry.ack = {"stop": "checkpoint"}
            seen["stop_at"] = time.time()
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            seen["error"] = repr(err)
            telemetry.ack = {"stop": "checkpoint"}  # the open-ended job ends anyway

    thread = threading.Thread(target=interfere, daemon=True)
    thread.start()
    storage = tmp_path / "runs"
    try:
        first_run = run(job_id, _spec(tmp_path, OPEN_ENDED), storage)
        ended_at = time.time()
        thread.join(5)
    finally:
        telemetry.ack = {}
        # The shared cluster goes back to two worker nodes for the next tests, whichever was lost.
        if len(worker_nodes(c)) > 2:
            c.remove_node(spare)
    assert "error" not in seen, seen
    assert first_run.exit_code == 0, first_run.reason

    # 1. The replacement ran on another node than the lost one, and healed there.
    assert seen["moved"]["node_id"] != seen["lost_node"], seen

    # 2. Both died: the training went back to a persistent checkpoint (a multiple of the interval,
    # at most the last step reported) and on from there, on two replicas again.
    after_both = [r for r in telemetry.records(job_id) if r["ts"] > seen["both_at"]]
    resumed = min(r["iteration"] for r in after_both) - 1
    assert resumed % INTERVAL == 0 and resumed <= seen["both_killed_after"], (resumed, seen)
    assert any(r["replicas"] == 2 for r in after_both)
    # Said as restart_group says it (the replacement on another node healed: not a resume).
    resumes = [e for e in telemetry.events(job_id, "recovered") if e["ts"] < seen["stop_at"]]
    assert [(e["recovered_from"], e["iteration"]) for e in resumes] == [("persistent", resumed)], resumes
    assert resumes[0]["ts"] > seen["both_at"] and resumes[0]["steps_lost"] >= 0, resumes

    # 3. The stop: the survivor saved the step it stopped at; the run ended in seconds (the
    # replacement did not wait for peers that had left: that would take setup_timeout_s).
    (stopped,) = [e for e in telemetry.events(job_id, "stopped_on_request") if e["ts"] > seen["stop_at"]]
    assert stopped["checkpointed"], stopped
    assert ended_at - seen["stop_at"] < 60, ended_at - seen["stop_at"]

    # 4. The next launch resumes from exactly that step and trains to the end.
    relaunch_at = time.time()
    iters = stopped["iteration"] + AFTER_STOP
    second_run = run(job_id, _spec(tmp_path, iters), storage)
    assert second_run.exit_code == 0, second_run.reason
    later = [r for r in telemetry.records(job_id) if r["ts"] > relaunch_at]
    assert min(r["iteration"] for r in later) == stopped["iteration"] + 1
    assert [e["iteration"] for e in telemetry.events(job_id, "recovered") if e["ts"] > relaunch_at] == [
        stopped["iteration"]
    ]
    assert max(r["iteration"] for r in later) == iters
    records = telemetry.final_records(job_id)
    assert list(records) == list(range(1, iters + 1))
    last = [records[i]["loss"] for i in range(iters - 19, iters + 1)]
    assert sum(last) / len(last) < 0.7 * records[1]["loss"]  # it learned
    t0 = seen["lost_at"]
    print(
        f"node lost -> replacement started {seen['moved_at'] - t0:.1f} s; both killed at +{seen['both_at'] - t0:.1f} s,"
        f" both back +{seen['both_back_at'] - seen['both_at']:.1f} s later; stop at +{seen['stop_at'] - t0:.1f} s,"
        f" first launch ended {ended_at - seen['stop_at']:.1f} s after it (stopped at {stopped['iteration']});"
        f" relaunch {time.time() - relaunch_at:.1f} s"
    )
