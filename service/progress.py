"""How far a job is and when it should end: `progress`, `eta_s` and `restart_s` of the job record.

Kept in the job's `stats` (service/store/stats.py) by the two places that see the facts:
telemetry ingestion calls `observe_step` for every applied record (the step time the engine
measured), `transition` calls `on_transition` for every state change (so the time spent
restarting is measured by the same clock as the state history). `fields` turns them into the
three numbers the API serves; nothing here queries the store, so a page of 100 jobs costs no
extra query.

The ETA is the remaining iterations times the mean of the last STEP_WINDOW step times: recent
rather than overall, so a job whose pace changed (an elastic resize, a warm-up) is estimated at
its pace now. It leaves out what is not a step (checkpoint saves that block, evaluation, a
restart still to come): tests/service/test_progress.py states the margin it holds to.
"""

from __future__ import annotations

import math
import time
from typing import Any

STEP_WINDOW = 20  # step times kept for the ETA (stats["recent_steps"])


def observe_step(stats: dict[str, Any], step_time_s: float) -> None:
    """Remember one step's duration (the newest STEP_WINDOW are kept)."""
    if not math.isfinite(step_time_s) or step_time_s < 0:
        return
    recent = list(stats.get("recent_steps") or [])[-(STEP_WINDOW - 1) :]
    recent.append(float(step_time_s))
    stats["recent_steps"] = recent


def on_transition(stats: dict[str, Any], before: str, after: str, now: float) -> None:
    """Add the time spent in `restarting` to stats["restart_s"] when a job leaves it."""
    if after == "restarting" and before != "restarting":
        stats["restarting_since"] = now
    elif before == "restarting" and after != "restarting":
        since = stats.pop("restarting_since", None)
        if isinstance(since, int | float):
            stats["restart_s"] = stats.get("restart_s", 0.0) + max(0.0, now - since)


def fields(
    state: str,
    iteration: int | None,
    train_iters: int,
    stats: dict[str, Any] | None,
    now: float | None = None,
) -> dict[str, float | None]:
    """{progress, eta_s, restart_s} for the API. `progress` is iteration / train_iters (0..1, null
    before the first record); `eta_s` null when the job is not running or has no step time yet;
    `restart_s` the seconds spent restarting so far, the current restart included."""
    stats = stats or {}
    now = time.time() if now is None else now
    progress = None if iteration is None else min(1.0, max(0.0, iteration / max(1, train_iters)))
    recent = [s for s in stats.get("recent_steps") or [] if isinstance(s, int | float)]
    eta = None
    if state in ("running", "restarting") and recent and iteration is not None:
        eta = max(0, train_iters - iteration) * sum(recent) / len(recent)
    restart = float(stats.get("restart_s", 0.0))
    since = stats.get("restarting_since")
    if state == "restarting" and isinstance(since, int | float):
        restart += max(0.0, now - since)
    return {"progress": progress, "eta_s": eta, "restart_s": restart}
