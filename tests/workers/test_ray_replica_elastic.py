"""resilience.on_rank_failure: replace_replica in an elastic job (resources 2, min 1, max 2) on
the shared two-node cluster, one replica per node. Ray Train replaces a single replica group only
at an unchanged size; a resize restarts the whole group at the new replica count from the newest
checkpoint. So:

1. the job trains on 2 replicas;
2. replica 1's node is removed: replica 0 steps alone until Ray (once it counts the node gone)
   restarts the group on the node left, 1 replica, from replica 0's newest checkpoint;
3. the node comes back: the elastic monitor grows the group to 2 replicas again, from the
   checkpoint;
4. a rank of the grown group is killed: only its replica is replaced (it heals from its peer,
   which keeps stepping), no restart of the group;
5. the scheduler's stop ends the open-ended job at a step it saves.

Asserted on the job's records: every iteration once in the final records (each restart resumed
from a checkpoint the group before had committed, none lost), `replicas` 2 / 1 / 2 per phase,
MFU counted over the devices of each step's quorum on every size, the loss falls, and no Ray
Train actor or placement group is left behind. About 55 s on an idle 2-core machine, most of it
Ray's: noticing the lost node (~19 s) and starting the grown group (~18 s).
"""

from __future__ import annotations

import os
import signal
import threading
import time

from tests.environ import environment
from tests.ray_cluster import WORKER_NODE_ARGS, worker_nodes
from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import ray_train_leftovers, run

INTERVAL = 5  # checkpoint.interval


def _started(telemetry, job_id: str, after: float = 0.0) -> list[dict]:
    """replica_started events after `after`, oldest first."""
    return [e for e in telemetry.events(job_id, "replica_started") if e["ts"] > after]


def _both(started: list[dict]) -> list[dict] | None:
    """The first two replica_started events of a 2-replica group, or None before both came."""
    two = [e for e in started if e["replicas"] == 2]
    return two[:2] if len(two) >= 2 else None


def _print_timeline(telemetry, job_id: str, t0: float) -> None:
    for e in sorted(telemetry.events(job_id), key=lambda e: e["ts"]):
        if e["kind"] != "checkpoint_saved":
            fields = {k: e[k] for k in ("replica", "replicas", "iteration", "world_size", "heal_s", "causes") if k in e}
            print(f"{e['ts'] - t0:7.2f} {e.get('source')} {e['kind']} {fields}")


def _records_after(telemetry, job_id: str, after: float) -> list[dict]:
    return [r for r in telemetry.records(job_id) if r["ts"] > after]


def test_replicas_shrink_with_a_lost_node_grow_back_and_replace_one(ray_cluster, telemetry, tmp_path):
    """Over 30 s: a node removed and added back and a replica replaced: each a new Ray worker group on
    2 cores."""
    c = ray_cluster
    job_id = "ft-elastic"
    spec = job(
        training={"train_iters": 100_000, "log_interval": 40},
        checkpoint={"path": str(tmp_path / "ckpt"), "interval": INTERVAL},
        resources={"ranks": 2, "min_ranks": 1, "max_ranks": 2},
        resilience={"on_rank_failure": "replace_replica", "max_restarts": 6},
    )
    seen: dict = {}
    done: dict = {}

    def drive():  # the driver in a thread: Ray's cluster_utils adds nodes from the main thread only
        try:
            with environment(ELASTRON_RESIZE_INTERVAL_S="2"):
                done["result"] = run(job_id, spec, tmp_path / "runs")
        except BaseException as err:  # noqa: BLE001 - reported below
            done["error"] = repr(err)

    def alive(what: str):
        assert "result" not in done and "error" not in done, (f"the job ended before {what}", done)
        return True

    driver = threading.Thread(target=drive, daemon=True)
    started = time.time()
    driver.start()
    try:
        full = wait_for(lambda: alive("training") and _both(_started(telemetry, job_id)), 120, "2 replicas")
        wait_for(lambda: len(telemetry.records(job_id)) >= 2 * INTERVAL + 2, 120, "2 checkpoints on 2 replicas")
        # 1. Replica 1's node goes: Ray restarts the group on 1 replica.
        victim = next(e for e in full if e["replica"] == 1)["ranks"][0]["node_id"]
        seen["lost_at"] = lost_at = time.time()
        seen["before_loss"] = max(r["iteration"] for r in telemetry.records(job_id))
        c.remove_node(next(n for n in worker_nodes(c) if n.node_id == victim), allow_graceful=False)
        small = wait_for(
            lambda: alive("shrinking") and [e for e in _started(telemetry, job_id, lost_at) if e["replicas"] == 1],
            120,
            "1 replica",
        )[0]
        wait_for(
            lambda: alive("training on 1") and len(_records_after(telemetry, job_id, small["ts"])) >= INTERVAL + 2,
            120,
            "a checkpoint on 1 replica",
        )
        # 2. The node comes back: the job grows to 2 replicas.
        seen["added_at"] = added_at = time.time()
        c.add_node(**WORKER_NODE_ARGS)
        grown = wait_for(
            lambda: alive("growing") and _both(_started(telemetry, job_id, added_at)), 120, "2 replicas again"
        )
        regrown = grown[0]
        wait_for(
            lambda: alive("training on 2") and len(_records_after(telemetry, job_id, regrown["ts"])) >= INTERVAL + 2,
            120,
            "steps on 2 replicas again",
        )
        # 3. A kill within the grown group: only that replica is replaced.
        seen["killed_at"] = killed_at = time.time()
        os.kill(next(e for e in grown if e["replica"] == 1)["ranks"][0]["pid"], signal.SIGKILL)
        wait_for(
            lambda: alive("the heal")
            and [e for e in telemetry.events(job_id, "replica_rejoined") if e["ts"] > killed_at and "heal_s" in e],
            300,  # a cold replacement on a loaded 2-core machine
            "replica 1 healed",
        )
        healed_at = time.time()
        wait_for(lambda: alive("stepping") and len(_records_after(telemetry, job_id, healed_at)) >= 3, 60, "steps")
    except BaseException:
        _print_timeline(telemetry, job_id, started)  # what the job did, for the failure's report
        raise
    finally:
        telemetry.ack = {"stop": "checkpoint"}  # the open-ended job ends (the scheduler's stop)
        driver.join(120)
        telemetry.ack = {}
        # The shared cluster goes back to two worker nodes for the next tests.
        while len(worker_nodes(c)) < 2:
            c.add_node(**WORKER_NODE_ARGS)
    assert "result" in done, done
    result = done["result"]
    assert result.exit_code == 0, result.reason
    assert result.attempts == 1  # the resizes and the replacement were Ray's, inside the attempt

    records = telemetry.records(job_id)
    final = telemetry.final_records(job_id)
    last = max(final)
    assert list(final) == list(range(1, last + 1))  # every iteration, none lost

    def phase(start: float, end: float) -> list[dict]:
        return [r for r in records if start < r["ts"] <= end]

        # Each restart resumed from the newest checkpoint the group before had committed: no step
    # trained after its commit was trained again, none past the last record was skipped.
    saved = telemetry.events(job_id, "checkpoint_saved")
    for event in (small, regrown):
        before = [r["iteration"] for r in records if r["ts"] < event["ts"]]
        newest = max(e["iteration"] for e in saved if e["ts"] < event["ts"])
        resumed = min(r["iteration"] for r in records if r["ts"] > event["ts"]) - 1
        assert resumed % INTERVAL == 0 and newest <= resumed <= max(before), (resumed, newest, max(before))
    # Per phase, the replicas each step averaged over.
    two = phase(0, seen["lost_at"])
    one = phase(small["ts"], regrown["ts"])
    again = phase(regrown["ts"], killed_at)
    assert two and {r["replicas"] for r in two} == {2}
    assert one and {(r["replicas"], r["world_size"]) for r in one} == {(1, 1)}
    assert again and {(r["replicas"], r["world_size"]) for r in again} == {(2, 2)}
    # The kill in the grown group replaced replica 1 only: no group restart (replica 0's process
    # went on), and the job trained on 2 replicas after it healed.
    replaced = _started(telemetry, job_id, killed_at)
    assert [e["replica"] for e in replaced] == [1], replaced
    assert any(r["replicas"] == 2 for r in phase(healed_at, time.time())), "no step on 2 replicas after the heal"
    # MFU counts the FLOPs of the samples trained over the devices that trained them (one per
    # replica in the step's quorum) on every size: mfu x step time x replicas / model FLOPs is
    # 1 / the peak of one device, the same on every record (within the peak's measurement, which
    # each process may repeat: a replica's MFU counted over its own device alone is 2x off).
    per_peak = [r["mfu"] * r["step_time_s"] * r["replicas"] / r["model_flops"] for r in records]
    assert max(per_peak) < 1.4 * min(per_peak), (min(per_peak), max(per_peak))
    # It learned.
    first = [final[i]["loss"] for i in range(1, 6)]
    end = [final[i]["loss"] for i in range(last - 4, last + 1)]
    assert sum(end) / 5 < 0.8 * sum(first) / 5, (first, end)
    assert wait_for(lambda: ray_train_leftovers(c) == {"actors": [], "placement_groups": []} or None, 60, "cleanup")
    print(
        f"{time.time() - started:.1f} s; lost at {seen['before_loss']}, 1 replica from {small['ts'] - seen['lost_at']:.1f} s"
        f" after; MFU per-peak spread {max(per_peak) / min(per_peak):.3f}; grew back {regrown['ts'] - seen['added_at']:.1f} s after the node came; steps 2/1/2:"
        f" {len(two)}/{len(one)}/{len(again)}; stopped at {last}"
    )


def test_an_elastic_job_may_shrink_to_one_replica_but_is_asked_with_two():
    from engine.jobspec import parse_job
    from workers.replicas import check_replace_replica

    def why(**resources):
        spec = job(resilience={"on_rank_failure": "replace_replica"}, resources=resources)
        return check_replace_replica(parse_job(spec))

    assert why(ranks=2, min_ranks=1, max_ranks=2) is None
    assert "resources.ranks >= 2" in why(ranks=1, min_ranks=1, max_ranks=2)
