"""resilience.on_rank_failure: replace_replica when the job's Lighthouse dies (its actor's
process killed, as the OOM killer on the head node would): every replica's quorum would wait
its timeout (resilience.step_timeout_s, up to 60 s) and Ray's backend would keep asking the dead
actor for its address, each start failing, until the controller waited on a placement group
forever (seen before the fix: no event, no step, for as long as one waited). Now each replica's
liveness link sees the Lighthouse's end close and fails the rank at once through its watchdog
(a `lighthouse_lost` event naming the Lighthouse and the replica), and the backend starts a new Lighthouse for
the replicas Ray starts again: the job goes on from its newest checkpoint and finishes."""

from __future__ import annotations

import os
import signal
import threading
import time

from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import run

ITERS = 300
INTERVAL = 40  # checkpoint.interval
STEP_TIMEOUT_S = 60.0  # the replicas' quorum timeout, which the relay's link must beat


def _lighthouses() -> list[int]:
    from ray.util.state import list_actors

    alive = list_actors(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
    return [a.pid for a in alive if a.class_name == "_LighthouseActor"]


def test_a_lost_lighthouse_fails_the_replicas_at_once_and_a_new_one_takes_over(
    ray_cluster, telemetry, tmp_path
):
    """Over 30 s: the replicas' group started twice on Ray (the lighthouse lost, then a new one), and
    the reference run."""
    job_id = "ft-lighthouse-loss"
    seen: dict = {}

    def reached() -> int:
        return max((r["iteration"] for r in telemetry.records(job_id)), default=0)

    def interfere():
        try:
            wait_for(lambda: reached() >= 2 * INTERVAL + 5, 120, f"iteration {2 * INTERVAL + 5}")
            (pid,) = _lighthouses()
            seen.update(lighthouse=pid, reached=reached(), killed_at=time.time())
            os.kill(pid, signal.SIGKILL)
            # The first step taken again: the replicas resume from a checkpoint before the kill
            # (a step or two in flight at the kill may still report after it).
            first = wait_for(
                lambda: [
                    r
                    for r in telemetry.records(job_id)
                    if r["ts"] > seen["killed_at"] and r["iteration"] <= seen["reached"]
                ],
                120,
                "a step after the Lighthouse's loss",
            )[0]
            seen["back_s"] = first["ts"] - seen["killed_at"]
            seen["new_lighthouses"] = _lighthouses()
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            seen["error"] = repr(err)

    thread = threading.Thread(target=interfere, daemon=True)
    thread.start()
    spec = job(
        training={"train_iters": ITERS, "log_interval": 40},
        checkpoint={"path": str(tmp_path / "ckpt"), "interval": INTERVAL},
        resilience={
            "on_rank_failure": "replace_replica",
            "max_restarts": 4,
            "warm_restart": True,
            "step_timeout_s": STEP_TIMEOUT_S,
        },
    )
    result = run(job_id, spec, tmp_path / "runs")
    thread.join(5)
    assert "error" not in seen, seen
    assert result.exit_code == 0, result.reason
    assert max(telemetry.final_records(job_id)) == ITERS
    # A new Lighthouse serves the replicas started again.
    assert seen["new_lighthouses"] and seen["lighthouse"] not in seen["new_lighthouses"], seen
    # The replicas failed on the link's notice, not at their quorum timeout; each says why, and
    # not as a timeout.
    failed = [e for e in telemetry.events(job_id, "lighthouse_lost") if e["ts"] > seen["killed_at"]]
    assert failed and all("Lighthouse" in e["message"] and e["replica"] in (0, 1) for e in failed), failed
    assert not telemetry.events(job_id, "watchdog_timeout"), telemetry.events(job_id, "watchdog_timeout")
    assert seen["back_s"] < STEP_TIMEOUT_S / 2, seen
    # From the newest checkpoint at or before the step the Lighthouse died at.
    after = [r for r in telemetry.records(job_id) if r["ts"] > seen["killed_at"]]
    resumed = min(r["iteration"] for r in after) - 1
    assert resumed % INTERVAL == 0 and resumed <= seen["reached"], (resumed, seen)
    # The quorum's first replica says so, as restart_group's rank 0 would: from the checkpoint,
    # with the steps lost since the step it last reported (at most a second before the kill).
    (back,) = [e for e in telemetry.events(job_id, "recovered") if e["ts"] > seen["killed_at"]]
    assert (back["recovered_from"], back["iteration"]) == ("persistent", resumed), back
    assert back["reached"] >= INTERVAL and back["steps_lost"] == max(0, back["reached"] - resumed), back
    print(
        f"replicas failed {[round(e['ts'] - seen['killed_at'], 2) for e in failed]} s after the kill; "
        f"first step again after {seen['back_s']:.1f} s, from {resumed}; "
        f"steps_lost {back['steps_lost']} (last told {back['reached']}, telemetry had {seen['reached']})"
    )
