"""What running on Ray costs a training step, against the engine's local launcher.

overhead: the same MEDIUM spec trained by the engine's local launcher (what `elastron train`
runs: `engine.launcher.spawn(train_rank)`) and by `workers` on Ray, steady-state iterations only,
alternating `--rounds` times; `ratio_ray_over_local` for the step time the engine measures
(`step_time_s`, the same code in both) and for the wall time per iteration (the loop, telemetry
included), per round and the median.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.recovery_modes.harness import MEDIUM, MEDIUM_LABEL, Receiver, emit, job_spec, steady, train_on_ray


def _stamp(record: dict) -> None:
    record["ts"] = time.time()  # the same dict train_rank keeps and returns


def local_run(spec: dict) -> list[dict]:
    from engine.launcher import spawn
    from engine.train_loop import train_rank

    return spawn(train_rank, 2, (spec, None, True, None, _stamp), timeout_s=1800)[0]


def overhead(
    receiver: Receiver, workdir: Path, iterations: int, rounds: int, ray_runs: dict[int, list[dict]] | None = None
) -> None:
    """Local and Ray runs alternate, so load from elsewhere on the machine hits both. `ray_runs`:
    the records of Ray runs of this spec already made (--smoke: snapshot_overhead's plain run)."""
    spec = job_spec(MEDIUM, iterations)
    ratios: dict[str, list[float]] = {"step_time_s": [], "wall_s_per_iteration": []}
    for r in range(rounds):
        local = steady(local_run(spec))
        if ray_runs and r in ray_runs:
            on_ray = steady(ray_runs[r])
        else:
            on_ray = steady(train_on_ray(receiver, f"overhead-{r}", spec, str(workdir / f"runs-{r}")))
        for i, figure in enumerate(ratios):
            ratios[figure].append(on_ray[i] / local[i])
            emit(
                figure=figure,
                **MEDIUM_LABEL,
                round=r,
                local=round(local[i], 4),
                ray=round(on_ray[i], 4),
                ratio_ray_over_local=round(on_ray[i] / local[i], 3),
            )
    for figure, values in ratios.items():
        emit(
            figure=f"{figure}_ratio_ray_over_local",
            **MEDIUM_LABEL,
            value=round(statistics.median(values), 3),
            rounds=rounds,
        )
