"""Sweeps and their trials in the store (tables `sweeps`, `sweep_trials`): created by the API,
advanced by the reconciler (service/reconcile/sweeps.py), read by both."""

from __future__ import annotations

import math
import secrets
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.store.models import JobMetric, Sweep, SweepTrial

SWEEP_STATES = ("running", "completed", "cancelled")
SWEEP_FINAL = frozenset({"completed", "cancelled"})
TRIAL_STATES = ("waiting", "running", "pruning", "complete", "pruned", "failed")
TRIAL_ACTIVE = frozenset({"waiting", "running", "pruning"})  # waiting: drawn, its job not made yet


def new_sweep_id(name: str) -> str:
    return f"sweep-{name}-{secrets.token_hex(4)}"


def create_sweep(session: Session, *, sweep_id: str, tenant: str, admin: bool, spec: dict[str, Any]) -> Sweep:
    now = time.time()
    sweep = Sweep(
        id=sweep_id,
        tenant=tenant,
        admin=admin,
        name=spec["name"],
        spec=spec,
        state="running",
        created_at=now,
        updated_at=now,
        trials_started=0,
        gpu_seconds=0.0,
    )
    session.add(sweep)
    session.flush()
    return sweep


def get_sweep(session: Session, sweep_id: str) -> Sweep | None:
    return session.get(Sweep, sweep_id)


def trials_of(session: Session, sweep_id: str) -> list[SweepTrial]:
    return list(
        session.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id).order_by(SweepTrial.number))
    )


def metric_points(
    session: Session, job_id: str, metric: str, after: int = 0, limit: int = 10_000, newest: bool = False
) -> list[tuple[int, float]]:
    """(iteration, value) of `metric` in the job's stored records after iteration `after`, in
    order: the first `limit` records, or with `newest` the last `limit`; records without a finite
    value of it are skipped."""
    order = JobMetric.iteration.desc() if newest else JobMetric.iteration
    rows = session.execute(
        select(JobMetric.iteration, JobMetric.record)
        .where(JobMetric.job_id == job_id, JobMetric.iteration > after)
        .order_by(order)
        .limit(limit)
    ).all()
    if newest:
        rows.reverse()
    out = []
    for iteration, record in rows:
        value = (record or {}).get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((int(iteration), float(value)))
    return out
