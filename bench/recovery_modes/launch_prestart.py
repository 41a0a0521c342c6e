"""How much sooner a job's ranks start when the driver asks their nodes for the rank processes
before it starts Ray Train's controller (workers/warm_processes.py, `prestart_for_launch`),
against Ray Train starting them itself (`WorkerRunOptions(prestart_ranks=False)`).

launch: the SMALL 2-rank job, which fills the local cluster's two CPUs (so the driver knows its
nodes), launched `rounds` times each way, alternating, with no idle process of the bench's Ray
job left before each launch (an earlier job's would serve either way). Per launch:
`ranks_up_s` (fit() -> rank 0's `ranks_started`) and `first_step_s` (-> the first step's
record); then the medians and `ratio_with_over_without` for both. On 2 cores the rank
processes' imports and the controller's compete for the CPUs; on a node with spare cores the
overlap is the controller's whole start.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

from bench.recovery_modes.harness import SMALL, Receiver, emit, job_spec, run_on_ray, wait_for


def _idle_workers() -> list[int]:
    """The bench's own cluster's idle Ray workers (`ray::IDLE`, children of its raylet)."""
    import ray
    from ray._private import ray_constants

    raylet = ray._private.worker._global_node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    idle = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ray::IDLE"):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == raylet:
                    idle.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return idle


def _end_idle_workers() -> None:
    """A warm process from an earlier job would take a rank in either kind of launch."""
    for pid in _idle_workers():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    wait_for(lambda: not _idle_workers(), 30)


def _launch(receiver: Receiver, job_id: str, workdir: Path, iters: int, prestart: bool) -> dict[str, float]:
    _end_idle_workers()
    receiver.records.clear()
    receiver.events.clear()
    spec = job_spec(SMALL, iters)
    spec["checkpoint"] = {"interval": iters}
    spec["resilience"] = {"warm_restart": False}  # no processes asked for after the first step
    began = time.time()
    result = run_on_ray(job_id, spec, str(workdir / job_id), prestart_ranks=prestart)
    if result.exit_code != 0:
        raise SystemExit(f"bench: launch {job_id} failed: {result}")
    started = next(e for e in receiver.events if e["kind"] == "ranks_started")
    return {
        "ranks_up_s": started["ts"] - began,
        "first_step_s": min(r["ts"] for r in receiver.records) - began,
    }


def launch(receiver: Receiver, workdir: Path, rounds: int, iters: int = 20) -> None:
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for r in range(rounds):
        for prestart in (False, True):
            got = _launch(receiver, f"launch-{r}-{'ahead' if prestart else 'ray'}", workdir, iters, prestart)
            runs[prestart].append(got)
            emit(figure="launch", round=r, prestart=prestart, **{k: round(v, 2) for k, v in got.items()})
    for figure in ("ranks_up_s", "first_step_s"):
        without = statistics.median(run[figure] for run in runs[False])
        with_ = statistics.median(run[figure] for run in runs[True])
        emit(
            figure=f"launch_{figure}",
            value=round(with_, 2),
            without_prestart=round(without, 2),
            ratio_with_over_without=round(with_ / without, 3),
            ranks=SMALL["resources"]["ranks"],
            rounds=rounds,
        )
