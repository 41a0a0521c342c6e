"""What in-memory snapshots cost a training step, against the same job without them.

- snapshot_overhead: the MEDIUM job on Ray without and with `local_interval: N`
  (`--local-interval`, default 1), alternating `--rounds` times (each first in every other
  round): mean wall seconds per steady-state iteration (the snapshot is taken between steps,
  outside the engine's `step_time_s`) and their ratio (`mode` none / memory).
- snapshot_overhead_interleaved: one Ray job with a snapshot every third step, each snapshot's
  cost read against the clean step of its cycle (see the function): drift-free; median and
  quartiles over the cycles. It charges a snapshot with everything that slows the two steps
  around it, so it reads above the every-step pairs: an upper bound.
- snapshot_work_ratio: the same job's ranks outside Ray (the engine's launcher), every step
  followed by a snapshot captured and sealed on the training thread, each timed: 1 + (capture +
  seal) / step, per rank and layout (plain DP=2; ZeRO-1 over DP=2), with the snapshot's bytes
  against the state's (a rank keeps its slice of what its data-parallel replicas share). The CPU
  the snapshots add, free of the several percent by which wall time swings between two jobs on a
  shared machine. `param_shaped_optim_ms`: the persistent checkpoint's optimizer part on the same
  rank (parameter-shaped, assembled over DP under ZeRO-1), which snapshots no longer build.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.recovery_modes.harness import (
    MEDIUM,
    MEDIUM_LABEL,
    WARMUP,
    Receiver,
    emit,
    job_spec,
    steady,
    train_on_ray,
)


def snapshot_overhead(
    receiver: Receiver, workdir: Path, iterations: int, rounds: int, local_interval: int = 1
) -> dict[int, list[dict]]:
    """Wall time per steady-state iteration on Ray without and with in-memory snapshots every step.
    Returns each round's records of the run without snapshots (the overhead figure's Ray run in
    --smoke: the same spec)."""
    walls: dict[str, list[float]] = {"none": [], "memory": []}
    plain: dict[int, list[dict]] = {}  # round -> the records of its run without snapshots
    for r in range(rounds):
        # Each mode first in every other round: the first job of a round starts while the last
        # one's processes are still going away.
        for mode in ("none", "memory") if r % 2 == 0 else ("memory", "none"):
            spec = job_spec(MEDIUM, iterations)
            if mode == "memory":
                spec["checkpoint"] = {"local_interval": local_interval}
                # The snapshots' per-step cost only: the warm processes' one-time start (seconds
                # of imports in new processes, on two cores) is the recovery figure's business.
                spec["resilience"] = {"warm_restart": False}
            records = train_on_ray(receiver, f"snapshots-{mode}-{r}", spec, str(workdir / f"runs-{mode}-{r}"))
            if mode == "none":
                plain[r] = records
            step, _ = steady(records)
            # The mean, not the median: with local_interval > 1 only every N-th step snapshots.
            recs = sorted(
                (r for r in records if r["iteration"] > WARMUP), key=lambda r: r["iteration"]
            )
            wall = (recs[-1]["ts"] - recs[0]["ts"]) / (recs[-1]["iteration"] - recs[0]["iteration"])
            walls[mode].append(wall)
            emit(
                mode=mode,
                local_interval=local_interval if mode == "memory" else None,
                figure="wall_s_per_iteration",
                **MEDIUM_LABEL,
                round=r,
                value=round(wall, 4),
                step_time_s=round(step, 4),
            )
    ratios = [m / n for m, n in zip(walls["memory"], walls["none"], strict=True)]
    emit(
        mode="memory",
        figure="snapshot_overhead_ratio",
        local_interval=local_interval,
        **MEDIUM_LABEL,
        value=round(statistics.median(ratios), 3),
        per_round=[round(x, 3) for x in ratios],
        rounds=rounds,
    )
    return plain


def snapshot_overhead_interleaved(receiver: Receiver, workdir: Path, cycles: int = 60) -> None:
    """One Ray job with a snapshot every 3rd step, so that the cost shows step by step against
    clean steps of the same job (the wall time of two jobs differs by more than the overhead on
    a shared machine). Records carry rank 0's time when it hands them on, after the step's
    snapshot was captured: iteration 3k's wall time holds the capture, 3k+1's the background seal
    and push it overlaps, 3k+2 is clean. Per cycle, (w[3k] + w[3k+1] - 2 w[3k+2]) / w[3k+2] is
    what a snapshot adds to one step: the overhead of a snapshot every step."""
    start = WARMUP + (-WARMUP % 3)  # the first cycle starts at a multiple of 3
    spec = job_spec(MEDIUM, start + 3 * cycles + 1)
    spec["checkpoint"] = {"local_interval": 3}
    spec["resilience"] = {"warm_restart": False}
    records = train_on_ray(receiver, "snapshots-interleaved", spec, str(workdir / "runs-interleaved"))
    ts = {r["iteration"]: r["ts"] for r in records}
    wall = {i: ts[i] - ts[i - 1] for i in ts if i - 1 in ts}
    costs = [
        (wall[k] + wall[k + 1] - 2 * wall[k + 2]) / wall[k + 2]
        for k in range(start + 3, start + 3 * cycles, 3)
        if all(i in wall for i in (k, k + 1, k + 2))
    ]
    quartiles = statistics.quantiles(costs, n=4)
    clean = statistics.median(wall[k + 2] for k in range(start + 3, start + 3 * cycles, 3) if k + 2 in wall)
    emit(
        mode="memory",
        figure="snapshot_overhead_interleaved",
        **MEDIUM_LABEL,
        value=round(1 + statistics.median(costs), 4),
        p25=round(1 + quartiles[0], 4),
        p75=round(1 + quartiles[2], 4),
        cycles=len(costs),
        clean_step_s=round(clean, 4),
    )


def _snapshot_work(spec: dict, steps: int) -> dict:
    """Rank function: the MEDIUM job's steps, each followed by a snapshot captured and sealed on
    the training thread, every part timed (medians after the warm-up)."""
    from engine import parallel_state as ps
    from engine.checkpointing.state import OptimizerState
    from engine.jobspec import JobSpec
    from engine.training import Trainer

    trainer = Trainer(JobSpec.model_validate(spec))
    buffer, times = None, {"step": [], "capture": [], "seal": [], "param_shaped_optim": []}
    # What the optimizer part of a persistent checkpoint builds (parameter-shaped, assembled over
    # DP under ZeRO-1): the snapshots' optimizer part before it kept the optimizer's own shards.
    persistent_optim = OptimizerState(trainer.optimizer, trainer.model_chunks, trainer.ddp_chunks)
    for i in range(WARMUP + steps):
        t0 = time.perf_counter()
        trainer.train_step()
        t1 = time.perf_counter()
        snap = trainer.capture_snapshot(buffer)
        t2 = time.perf_counter()
        snap.seal()
        t3 = time.perf_counter()
        persistent_optim.state_dict()
        t4 = time.perf_counter()
        buffer = snap.block.obj
        if i >= WARMUP:
            for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[name].append(seconds)
    out = {name: statistics.median(v) for name, v in times.items()}
    out["block_bytes"] = len(snap.block)
    out["state_bytes"] = sum(row[5] for row in snap.index)
    ps.destroy_model_parallel()
    return out


def snapshot_work(steps: int = 30) -> None:
    """The CPU an every-step snapshot adds, measured inside the ranks (the wall-clock ratio above
    swings by several percent between jobs on a shared 2-core machine): capture + seal over the
    step time of the same run, per rank."""
    from engine.launcher import spawn

    for layout, parallel in (("dp2", {}), ("zero1-dp2", {"distributed_optimizer": True})):
        spec = job_spec(MEDIUM, WARMUP + steps)
        spec["parallel"] = parallel
        for rank, r in enumerate(spawn(_snapshot_work, 2, (spec, steps), timeout_s=1800)):
            emit(
                mode="memory",
                figure="snapshot_work_ratio",
                model=MEDIUM_LABEL["model"],
                layout=layout,
                rank=rank,
                value=round(1 + (r["capture"] + r["seal"]) / r["step"], 4),
                step_ms=round(r["step"] * 1e3, 1),
                capture_ms=round(r["capture"] * 1e3, 2),
                seal_ms=round(r["seal"] * 1e3, 2),
                param_shaped_optim_ms=round(r["param_shaped_optim"] * 1e3, 2),
                snapshot_bytes=r["block_bytes"],
                state_bytes=r["state_bytes"],
            )
