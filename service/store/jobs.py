"""Job rows and their history: creation, state transitions, events.

Every state change goes through `transition`, which writes the new state and an event with the
reason in the caller's transaction, so what the API reports and why are always stored together
and before anything acts on them (the reconciler commits a launch intent before calling Ray).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service import progress
from service.states import FINAL, JobState, can_move
from service.store import stats as job_stats
from service.store.models import Job, JobEvent

log = logging.getLogger(__name__)


def new_job_id(name: str) -> str:
    return f"{name}-{secrets.token_hex(4)}"


def add_event(
    session: Session,
    job: Job,
    kind: str,
    message: str | None = None,
    *,
    iteration: int | None = None,
    data: dict[str, Any] | None = None,
    ts: float | None = None,
    dedup_key: str | None = None,
) -> JobEvent:
    now = time.time()
    event = JobEvent(
        job_id=job.id,
        ts=now if ts is None else ts,
        recorded_at=now,
        kind=kind,
        iteration=iteration,
        message=message,
        data=data or {},
        dedup_key=dedup_key,
    )
    session.add(event)
    job.updated_at = now
    return event


def transition(
    session: Session, job: Job, to: JobState, reason: str, *, stats: dict[str, Any] | None = None, **data: Any
) -> bool:
    """Move `job` to `to` with `reason`; an illegal move is recorded as an event and not applied.

    `stats`: the caller's working copy of `job.stats`, when it assigns that copy back itself."""
    if job.state == to:
        return False
    if not can_move(job.state, to):
        log.info("job %s: ignored %s -> %s (%s)", job.id, job.state, to, reason)
        add_event(
            session,
            job,
            "transition_ignored",
            f"{job.state} -> {to} is not a legal move: {reason}",
            data={"from": job.state, "to": str(to), **data},
        )
        return False
    add_event(session, job, "state", reason, data={"from": job.state, "to": str(to), **data})
    now = job.updated_at
    before = job.state
    job.state = str(to)
    if to == JobState.RUNNING and job.started_at is None:
        job.started_at = now
    if to in FINAL:
        job.finished_at = now
    if stats is not None:
        job_stats.count(stats, "transitions", str(to))
        progress.on_transition(stats, before, str(to), now)
    else:
        edited = job_stats.editable(job.stats)
        job_stats.count(edited, "transitions", str(to))
        progress.on_transition(edited, before, str(to), now)
        job.stats = edited
    return True


def fail(session: Session, job: Job, cause: str, **data: Any) -> bool:
    if transition(session, job, JobState.FAILED, cause, **data):
        job.failure_cause = cause
        return True
    return False


def create_job(
    session: Session,
    *,
    job_id: str,
    tenant: str,
    spec: dict[str, Any],
    idempotency_key: str | None,
    request_hash: str | None,
) -> Job:
    now = time.time()
    job = Job(
        id=job_id,
        tenant=tenant,
        name=spec["name"],
        spec=spec,
        state=str(JobState.QUEUED),
        created_at=now,
        updated_at=now,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        attempt=0,
        launch_failures=0,
        train_iters=spec["training"]["train_iters"],
        iteration_epoch=0,
        restarts=0,
        stats={"transitions": {str(JobState.QUEUED): 1}},
    )
    session.add(job)
    session.flush()  # the job row exists before its first event refers to it
    add_event(session, job, "state", "submitted", data={"from": None, "to": str(JobState.QUEUED)})
    return job


def get_job(session: Session, job_id: str) -> Job | None:
    return session.scalar(select(Job).where(Job.id == job_id))


def find_by_idempotency_key(session: Session, tenant: str, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.tenant == tenant, Job.idempotency_key == key))


def request_cancel(session: Session, job: Job, who: str) -> None:
    """Record a cancel of a job that has not ended: a queued job not yet launched is cancelled at
    once; a launched one gets a graceful stop from the reconciler (service/reconcile/stops.py) and
    is cancelled when the launcher confirms it."""
    if job.state in FINAL:
        return
    if job.cancel_requested_at is None:
        job.cancel_requested_at = time.time()
        add_event(session, job, "cancel_requested", f"cancel requested by {who}")
    if job.state == JobState.QUEUED and job.submission_id is None:
        transition(session, job, JobState.CANCELLED, "cancelled before launch")
