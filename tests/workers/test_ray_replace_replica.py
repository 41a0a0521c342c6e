"""resilience.on_rank_failure: replace_replica on the shared 2-node cluster (conftest.py: two
one-CPU worker nodes, one replica per node): SIGKILL one replica's rank; the other replica keeps
stepping (its records go on, averaged over one replica) while Ray Train's controller replaces the
dead one, which heals from its live peer (the same state digest on both sides) and rejoins the
quorum; nine more kills of the replacement as it starts do not deadlock; the job finishes.

The final loss is compared with the uninterrupted run (`elastron train`, DP=2, restart_group).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import elastron_train, run

ITERS = 240
KILLS = int(os.environ.get('FT_KILLS', 10))


def _spec(tmp_path, **resilience) -> dict:
    return job(
        training={"train_iters": ITERS, "log_interval": 40},
        checkpoint={"path": str(tmp_path / "ckpt"), "interval": 80},
        resilience={"max_restarts": KILLS + 2, **resilience},
    )


def _replica_pid(telemetry, job_id: str, replica: int, after: float = 0.0) -> int | None:
    started = [
        e for e in telemetry.events(job_id, "replica_started") if e["replica"] == replica and e["ts"] > after
    ]
    return started[-1]["ranks"][0]["pid"] if started else None


def test_a_killed_replica_is_replaced_while_the_other_keeps_stepping(ray_cluster, telemetry, tmp_path):
    job_id = "ft-replace"
    seen: dict = {"kills": []}

    def interfere():
        pid = wait_for(lambda: _replica_pid(telemetry, job_id, 1), what="replica 1 started", timeout_s=120)
        wait_for(lambda: any(r["iteration"] >= 10 for r in telemetry.records(job_id)), what="iteration 10")
        killed_at = time.time()
        reached = max(r["iteration"] for r in telemetry.records(job_id))
        os.kill(pid, signal.SIGKILL)
        seen["kills"].append(pid)
        # The survivor keeps stepping on its own while replica 1 is replaced.
        wait_for(
            lambda: [r for r in telemetry.records(job_id) if r["iteration"] > reached + 3 and r["replicas"] == 1],
            what="the survivor stepping alone",
            timeout_s=60,
        )
        seen["survivor_steps_alone"] = True
        wait_for(
            lambda: [e for e in telemetry.events(job_id, "replica_rejoined") if e["ts"] > killed_at],
            what="replica 1 rejoining",
            timeout_s=120,
        )
        # Nine more in a row: each replacement killed as soon as it has started.
        for _ in range(KILLS - 1):
            pid = wait_for(
                lambda: (p := _replica_pid(telemetry, job_id, 1)) not in seen["kills"] and p,
                what="a replacement of replica 1",
                timeout_s=120,
            )
            os.kill(pid, signal.SIGKILL)
            seen["kills"].append(pid)
        seen["done"] = True

    threading.Thread(target=interfere, daemon=True).start()
    result = run(job_id, _spec(tmp_path, on_rank_failure="replace_replica", warm_restart=True), tmp_path / "runs")
    assert result.exit_code == 0, result.reason
    assert seen.get("survivor_steps_alone"), seen
    assert seen.get("done") and len(seen["kills"]) == KILLS, seen
    rejoined = telemetry.events(job_id, "replica_rejoined")
    healed = [e for e in rejoined if "heal_s" in e]
    survivors = [e for e in rejoined if "rejoin_s" in e]
    assert healed and survivors, rejoined
    # Bitwise: the healed replica's state and its peer's at the step it rejoined.
    by_step = {e["iteration"]: e["state_digest"] for e in survivors}
    assert any(by_step.get(e["iteration"]) == e["state_digest"] for e in healed), (healed, survivors)
    for e in healed:
        if e["iteration"] in by_step:
            assert by_step[e["iteration"]] == e["state_digest"], (e, by_step)
    assert telemetry.events(job_id, "replica_lost")
    records = telemetry.final_records(job_id)
    assert max(records) == ITERS
    assert {r["replicas"] for r in records.values()} == {1, 2}
    seen["final_loss"] = records[ITERS]["loss"]
    seen["alone"] = sum(r["replicas"] == 1 for r in records.values())
    reference = {r["iteration"]: r["loss"] for r in elastron_train(_spec(tmp_path / "ref"), tmp_path / "ref")}
    print("final", seen["final_loss"], "reference", reference[ITERS], "steps alone", seen["alone"])
    assert seen["final_loss"] == pytest.approx(reference[ITERS], rel=0.05)
