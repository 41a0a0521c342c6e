"""How long a job on Ray takes to recover from a SIGKILLed rank, against the same job's cold start.

A 2-rank SMALL job on local Ray, one rank killed with SIGKILL mid-interval between two
persistent checkpoints (its pid from the rank's own report), once the job has trained for
SETTLE_S seconds (its warm processes for a restart are ready by then). Every line carries
`"mode"`: `persistent` (persistent checkpoints only, every 10 steps: the "before") or `memory`
(the same plus in-memory checkpoints every step, `checkpoint.local_interval: 1`: the "after").
`sigkill_to_first_step_s`: from the kill to the first step completed after the resume, split
into `detect_s` (kill -> the driver has the failure), `restart_s` (-> the new ranks are up) and
`resume_s` (-> the resumed job's first step); `steps_reexecuted`: steps done before the kill
that ran again; `restart_breakdown_s`: the new group's phases as rank 0's `recovered` event
reports them (group start: fit() -> the rank function runs, i.e. Ray Train's worker actors,
their placement group and the torch process group; imports; registry and telemetry; model
build + persistent resume; the agreement over the in-memory snapshots; their restore) and
where it recovered from; `ratio_over_cold_start`: the recovery time over the same job's cold
start (fit() -> its first step) in the same run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from bench.recovery_modes.harness import SMALL, Receiver, emit, job_spec, run_on_ray, wait_for

# Seconds a recovery job trains before the kill.
SETTLE_S = 15.0
TRAIN_ITERS = {"persistent": 1500, "memory": 700}
# --smoke: the kill after this long (warm processes may still be starting: a slower restart),
# in jobs this long (still longer than the kill takes to land).
SMOKE_SETTLE_S = 2.0
SMOKE_TRAIN_ITERS = {"memory": 60}


def recovery(
    receiver: Receiver,
    workdir: Path,
    repeat: int,
    mode: str,
    settle_s: float = SETTLE_S,
    train_iters: dict[str, int] = TRAIN_ITERS,
) -> None:
    job_id = f"recovery-{mode}-{repeat}"
    # Long enough to outlast SETTLE_S on this machine (a snapshot every step makes the memory
    # job's tiny steps slower), not much longer: the job trains to the end after the recovery.
    spec = job_spec(SMALL, train_iters[mode])
    spec["checkpoint"]["path"] = str(workdir / "ckpt")
    if mode == "memory":
        spec["checkpoint"]["local_interval"] = 1
    spec["resilience"] = {"max_restarts": 1}
    marks: dict = {}

    def kill():
        started = wait_for(lambda: [e for e in receiver.events if e["kind"] == "ranks_started"][-1:])
        victim = next(r for r in started[0]["ranks"] if r["rank"] == 1)
        # A job that has run a while (its warm processes are ready: a failure in a job's first
        # seconds meets cold processes, as its cold start did), killed mid-interval: the newest
        # persistent checkpoint is 5-9 steps old.
        settled = started[0]["ts"] + settle_s
        interval = SMALL["checkpoint"]["interval"]
        late = train_iters[mode] // 2  # a fast machine: do not wait for the job's end
        wait_for(
            lambda: any(
                (r["ts"] >= settled or r["iteration"] >= late) and r["iteration"] % interval >= interval // 2
                for r in receiver.records
            )
        )
        marks["killed_at"] = time.time()
        os.kill(victim["pid"], signal.SIGKILL)

    receiver.records.clear()
    receiver.events.clear()
    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    marks["fit_at"] = time.time()
    result = run_on_ray(job_id, spec, str(workdir / "runs"))
    killer.join(timeout=60)
    if result.exit_code != 0 or "killed_at" not in marks:
        raise SystemExit(f"bench: the job did not recover: {result}")
    records = receiver.records
    before = [r for r in records if r["attempt"] == 0 and r["ts"] <= marks["killed_at"]]
    after = [r for r in records if r["attempt"] == 1]
    failed = next(e for e in receiver.events if e["kind"] == "attempt_failed")
    restarted = next(e for e in receiver.events if e["kind"] == "ranks_started" and e["attempt"] == 1)
    first_started = next(e for e in receiver.events if e["kind"] == "ranks_started" and e["attempt"] == 0)
    recovered = next((e for e in receiver.events if e["kind"] == "recovered"), {})
    cold = min(r["ts"] for r in records if r["attempt"] == 0) - marks["fit_at"]
    seconds = after[0]["ts"] - marks["killed_at"]
    resumed_from = after[0]["iteration"] - 1
    emit(
        mode=mode,
        figure="sigkill_to_first_step_s",
        value=round(seconds, 2),
        detect_s=round(failed["ts"] - marks["killed_at"], 2),
        restart_s=round(restarted["ts"] - failed["ts"], 2),
        resume_s=round(after[0]["ts"] - restarted["ts"], 2),
        repeat=repeat,
    )
    emit(
        mode=mode,
        figure="steps_reexecuted",
        value=max(r["iteration"] for r in before) - resumed_from,
        killed_after_iteration=max(r["iteration"] for r in before),
        resumed_from=resumed_from,
        recovered_from=recovered.get("recovered_from"),
        steps_lost_reported=recovered.get("steps_lost"),
        checkpoint_interval=SMALL["checkpoint"]["interval"],
        repeat=repeat,
    )
    emit(
        mode=mode,
        figure="restart_breakdown_s",
        value=recovered.get("phase_seconds"),
        first_step_after_rank_start_s=round(after[0]["ts"] - restarted["ts"], 2),
        recovered_from=recovered.get("recovered_from"),
        warm_process=recovered.get("warm_process"),
        repeat=repeat,
    )
    emit(
        mode=mode,
        figure="cold_start_to_first_step_s",
        value=round(cold, 2),
        ranks_up_s=round(first_started["ts"] - marks["fit_at"], 2),
        repeat=repeat,
    )
    emit(mode=mode, figure="ratio_over_cold_start", value=round(seconds / cold, 3), repeat=repeat)
