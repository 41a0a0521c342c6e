"""The scheduler's Prometheus counters and histogram, kept in the store (`scheduler_stats`).

In the API's memory they restarted from zero with every API process and lived only on the
replica that held the scheduling lease; here each is updated in the transaction that records
what it counts (an admission's wait, a preemption, a resize), and /metrics renders them from the
row (service/metrics.py), like the job series. Layout: service/store/stats.py's, one table per
series keyed by its labels joined with "\\x1f" in METRICS.md's label order:
  wait {tenant,priority: histogram}, preemptions {tenant,priority: n},
  resizes {tenant,priority,direction: n}.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy.orm import Session

from service.store import stats as job_stats
from service.store.models import SchedulerStats

ROW = "scheduler"
SEP = "\x1f"
# Seconds: from a job admitted at once to one that waited a day.
WAIT_BUCKETS = (1.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0)


def _edit(s: Session) -> tuple[SchedulerStats, dict[str, Any]]:
    row = s.get(SchedulerStats, ROW)
    if row is None:
        row = SchedulerStats(key=ROW, stats={})
        s.add(row)
    return row, job_stats.editable(row.stats)


def observe_wait(s: Session, tenant: str, priority: int, waited_s: float) -> None:
    row, stats = _edit(s)
    job_stats.observe(stats.setdefault("wait", {}), SEP.join((tenant, str(priority))), WAIT_BUCKETS, waited_s)
    row.stats = stats


def count(s: Session, series: str, *labels: Any) -> None:
    """`series`: "preemptions" (tenant, priority) or "resizes" (tenant, priority, direction)."""
    row, stats = _edit(s)
    job_stats.count(stats, series, SEP.join(str(v) for v in labels))
    row.stats = stats


def read(s: Session) -> dict[str, Any]:
    row = s.get(SchedulerStats, ROW)
    return dict(row.stats or {}) if row is not None else {}


def labelled(table: dict[str, Any] | None) -> Iterator[tuple[list[str], Any]]:
    for key, value in sorted((table or {}).items()):
        yield key.split(SEP), value
