"""The counters and histograms kept in `jobs.stats` (the source of the job's Prometheus series).

They live in the job row, updated in the same transaction as the telemetry that moves them, so
/metrics is one query and a restarted API continues each counter where it was.

Layout (every key optional):
  transitions {state: n}, tokens, skipped, energy_j, restarts {cause: n}, reruns {diagnosis: n},
  checkpoints {success|failure: n}, ckpt_retries, step {buckets: [...], sum, count} (step_time_s),
  ckpt_save {buckets, sum, count}, ckpt_bytes, timers {phase: [min, max]}, valid_loss,
  recoveries {memory|replica|persistent: n}, steps_lost, recovery_s {phase: seconds} (the last),
  recent_steps [s, ...], restart_s, restarting_since (service/progress.py),
  rank_step_s [s per rank], rank_slowness [ratio per rank], rank_steps, stragglers [rank, ...] (service/stragglers.py)
"""

from __future__ import annotations

import bisect
import copy
from typing import Any

# Upper bounds in seconds (+Inf implicit). Steps run from milliseconds (tiny CPU models) to
# minutes (large models); checkpoint saves from a second to many minutes.
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CHECKPOINT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def editable(stats: dict[str, Any] | None) -> dict[str, Any]:
    """A deep copy to change and assign back (SQLAlchemy sees a JSON column change on assignment)."""
    return copy.deepcopy(stats) if stats else {}


def count(stats: dict[str, Any], key: str, label: str, by: float = 1) -> None:
    table = stats.setdefault(key, {})
    table[label] = table.get(label, 0) + by


def add(stats: dict[str, Any], key: str, by: float) -> None:
    stats[key] = stats.get(key, 0) + by


def observe(stats: dict[str, Any], key: str, bounds: tuple[float, ...], value: float) -> None:
    """Add one observation to a histogram stored as per-bucket (non-cumulative) counts."""
    hist = stats.setdefault(key, {"buckets": [0] * (len(bounds) + 1), "sum": 0.0, "count": 0})
    hist["buckets"][bisect.bisect_left(bounds, value)] += 1
    hist["sum"] += value
    hist["count"] += 1


def cumulative_buckets(hist: dict[str, Any], bounds: tuple[float, ...]) -> list[tuple[str, float]]:
    """Prometheus' cumulative `le` buckets, +Inf last."""
    out, running = [], 0
    for bound, n in zip((*bounds, float("inf")), hist["buckets"], strict=True):
        running += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out
