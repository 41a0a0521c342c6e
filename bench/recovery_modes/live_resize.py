"""What a resize costs a job: `resilience.resize: live` (workers/replica_fits.py: replica groups
released and added inside the running attempt) against the restart-based resize the scheduler
does for other elastic jobs (save the current step, stop, launch again at the new size from that
checkpoint), on the same job, in the same run.

resize: the SMALL job as an elastic `replace_replica` job of 2 one-rank replica groups
(min_ranks 1, `lost_replica_share: redistribute`), on the bench's local cluster (its 2 CPUs),
shrunk to 1 replica group and grown back to 2, each way. The bench plays the control plane: the
request is its telemetry answer, as the service's scheduler gives it (`replicas: N` to a live job,
`stop: checkpoint` to the other, whose relaunch at the new size the bench then starts, as the
service's next scheduling pass does), after STEPS_BETWEEN steps and SETTLE_S seconds at the size
before. `resize_s` is from that answer's first delivery to the
first step trained at the new size (its record's `ts`), so it includes the driver's wait for its
next question to the control plane (every second, workers/replica_fits.py ASK_EVERY_S) and, on
the restart path, the checkpoint, the stop and a cold Ray job. `steps_lost`: iterations missing
from, or trained twice in, the job's records (a restart resumes the step it saved: none either
way). The figure: `live_over_restart` per direction, and the driver's own `resized` seconds for
the live resize (from its start of the resize to done).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from bench.recovery_modes.harness import SMALL, Receiver, emit, job_spec, run_on_ray, wait_for

ITERS = 100_000  # planned; every run here is stopped long before
STEPS_BETWEEN = 20  # steps trained at each size before the next request (SMOKE: 5)
# And seconds: a shared cluster's resizes of one job come minutes apart, time for the processes a
# live job's driver asks for ahead (a grow's controller side, a released group's ranks) to
# start; right after a resize they are still importing torch (a grow then took 8-9 s here).
SETTLE_S = 15.0


def _spec(resize: str, ranks: int, workdir: Path, most: int = 2) -> dict:
    """The job at `ranks` (`most`: its max_ranks; a restart-based relaunch runs at most at the
    size it was given, as the service's sized_spec has it, or Ray Train would grow it itself)."""
    spec = job_spec(SMALL, ITERS)
    spec["resources"] = {"ranks": ranks, "min_ranks": 1, "max_ranks": most, "device": "cpu"}
    spec["resilience"] = {"on_rank_failure": "replace_replica", "lost_replica_share": "redistribute", "resize": resize}
    spec["optimizer"] = {**spec["optimizer"], "lr_decay_iters": ITERS}  # one schedule across the relaunches
    spec["checkpoint"] = {"interval": 1000, "path": str(workdir / "ckpt")}
    return spec


class _Run:
    """One Ray job of the bench in a thread (run_on_ray blocks until the job ends)."""

    def __init__(self, job_id: str, spec: dict, workdir: Path):
        self.result = None
        self.thread = threading.Thread(
            target=lambda: setattr(self, "result", run_on_ray(job_id, spec, str(workdir / "ray"))), daemon=True
        )
        self.thread.start()

    def join(self, timeout_s: float = 300) -> None:
        self.thread.join(timeout_s)
        if self.thread.is_alive() or self.result is None:
            raise SystemExit("bench: a resize run did not end")


def _stepping_at(receiver: Receiver, run: _Run, replicas: int, since: float, steps: int) -> float:
    """The `ts` of the first step record at `replicas` replica groups trained after `since`,
    once `steps` such steps have arrived (the bench stops if `run` ends first)."""

    def at_size() -> float | None:
        got = sorted(r["ts"] for r in list(receiver.records) if r["ts"] > since and r.get("replicas") == replicas)
        if len(got) >= steps:
            return got[0]
        if not run.thread.is_alive():
            raise SystemExit(f"bench: the resize run ended before {steps} steps at {replicas} replicas: {run.result}")
        return None

    return wait_for(at_size, 300)


def _iterations(receiver: Receiver) -> tuple[int, int]:
    """(missing, trained twice) iterations in the records so far."""
    seen = [r["iteration"] for r in receiver.records]
    return max(seen) - len(set(seen)), len(seen) - len(set(seen))


def _resize_twice(receiver: Receiver, workdir: Path, way: str, steps: int, settle_s: float) -> dict[str, float]:
    """The job (`way`: its resilience.resize) shrunk 2 -> 1 and grown back: the seconds of each."""
    got: dict[str, float] = {}
    run = _Run(f"resize-{way}", _spec(way, 2, workdir), workdir)
    _stepping_at(receiver, run, 2, 0.0, steps)
    for name, replicas in (("shrink", 1), ("grow", 2)):
        time.sleep(settle_s)
        asked = time.time()
        if way == "live":
            receiver.answer = {"replicas": replicas}
        else:
            receiver.answer = {"stop": "checkpoint"}  # the service's request: save this step and stop
            run.join()
            receiver.answer = {}
            run = _Run(f"resize-{way}", _spec(way, replicas, workdir, most=replicas), workdir)  # its relaunch
        got[f"{name}_s"] = _stepping_at(receiver, run, replicas, asked, steps) - asked
        if way == "live":  # (a shrink steps at its new size before the released run has ended)
            resized = wait_for(
                lambda n=replicas: [e for e in list(receiver.events) if e["kind"] == "resized" and e["to_replicas"] == n],
                120,
            )
            got[f"{name}_driver_s"] = resized[-1]["seconds"]
    receiver.answer = {"stop": "checkpoint"}
    run.join()
    return got


def live_resize(receiver: Receiver, workdir: Path, smoke: bool = False) -> None:
    steps, settle_s = (5, 2.0) if smoke else (STEPS_BETWEEN, SETTLE_S)
    ways = {}
    for way in ("restart", "live"):
        receiver.records.clear()
        receiver.events.clear()
        receiver.answer = {}
        ways[way] = _resize_twice(receiver, workdir / way, way, steps, settle_s)
        missing, twice = _iterations(receiver)
        ways[way]["steps_lost"] = missing + twice
        emit(figure="resize", way=way, **{k: round(v, 3) for k, v in ways[way].items()})
    receiver.answer = {}
    for name in ("shrink", "grow"):
        live, restart = ways["live"][f"{name}_s"], ways["restart"][f"{name}_s"]
        emit(
            figure=f"resize_s_{name}",
            value=round(live, 3),
            driver_s=ways["live"][f"{name}_driver_s"],
            restart_s=round(restart, 3),
            live_over_restart=round(live / restart, 4),
            steps_lost={way: ways[way]["steps_lost"] for way in ways},
            replicas=(2, 1) if name == "shrink" else (1, 2),
        )
