"""A straggler: a rank slower than the job's median rank by more than MARGIN, over a window.

From the engine's per-rank timer (`timers_per_rank["forward-backward"]` of the metrics record,
engine/step_metrics.py: each rank's own compute in a step; its peers' waiting for it falls in the
gradient reduction, outside it). Each logged step gives every rank a ratio, its time over the
median rank's; a rank's slowness is the exponentially weighted mean of its ratios with weight
2 / (WINDOW + 1), about the last WINDOW logged steps. A rank whose slowness exceeds 1 + MARGIN,
after at least MIN_STEPS logged steps, is a straggler: an event `straggler` when it becomes one,
`straggler_cleared` when it no longer is; both and the numbers are kept in the job's stats
(`rank_step_s`, `rank_slowness`, `stragglers`) for /metrics and the job's page.

A change in the number of ranks (an elastic resize) starts the window again.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

TIMER = "forward-backward"
MARGIN = 0.25  # slower than the median by more than 25 %
WINDOW = 10  # logged steps (training.log_interval apart)
MIN_STEPS = 3  # no verdict from fewer


def _values(record: dict[str, Any]) -> list[float] | None:
    per_rank = record.get("timers_per_rank")
    values = per_rank.get(TIMER) if isinstance(per_rank, dict) else None
    if not isinstance(values, list) or len(values) < 2:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        return None
    return [float(v) for v in values]


def observe(stats: dict[str, Any], record: dict[str, Any]) -> list[dict[str, Any]]:
    """Fold one record's per-rank times into `stats`; return the events to record (kind,
    message, iteration, data) for ranks that became or stopped being stragglers."""
    values = _values(record)
    if values is None:
        return []
    median = statistics.median(values)
    if median <= 0:
        return []
    ratios = [v / median for v in values]
    previous = stats.get("rank_slowness")
    if not isinstance(previous, list) or len(previous) != len(ratios):
        slowness, steps = ratios, 1  # first sample, or another number of ranks
        before: set[int] = set()
    else:
        weight = 2.0 / (WINDOW + 1)
        slowness = [(1 - weight) * p + weight * r for p, r in zip(previous, ratios, strict=True)]
        steps = int(stats.get("rank_steps", 0)) + 1
        before = set(stats.get("stragglers") or [])
    now = {i for i, s in enumerate(slowness) if s > 1 + MARGIN} if steps >= MIN_STEPS else set()
    stats["rank_step_s"] = values
    stats["rank_slowness"] = [round(s, 4) for s in slowness]
    stats["rank_steps"] = steps
    stats["stragglers"] = sorted(now)
    iteration = record.get("iteration")
    events = []
    for rank in sorted(now - before):
        events.append(
            {
                "kind": "straggler",
                "message": f"rank {rank} is a straggler: its {TIMER} time is {slowness[rank]:.2f}x the median "
                f"rank's over about the last {WINDOW} logged steps (flagged above {1 + MARGIN:.2f}x)",
                "iteration": iteration,
                "data": {"rank": rank, "slowness": round(slowness[rank], 4), "step_s": values[rank], "median_s": median},
            }
        )
    for rank in sorted(before - now):
        events.append(
            {
                "kind": "straggler_cleared",
                "message": f"rank {rank} is no longer a straggler ({slowness[rank]:.2f}x the median)",
                "iteration": iteration,
                "data": {"rank": rank, "slowness": round(slowness[rank], 4)},
            }
        )
    return events
