"""Evaluation rows: creation (with the job's `eval_requested` event) and their end (with
`eval_succeeded` / `eval_failed`), each in the caller's transaction, so the job's events always
agree with the evaluation's status."""

from __future__ import annotations

import secrets
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.store.exports import FAILED, PENDING, RUNNING, SUCCEEDED, UNFINISHED
from service.store.jobs import add_event
from service.store.models import Evaluation, Job

__all__ = ["FAILED", "PENDING", "RUNNING", "SUCCEEDED", "UNFINISHED", "create_eval", "finish_eval", "get_eval"]


def create_eval(
    session: Session, job: Job, *, iteration: int, source: str, tasks: list[str], options: dict[str, Any]
) -> Evaluation:
    eval_id = f"eval-{secrets.token_hex(6)}"
    row = Evaluation(
        id=eval_id,
        job_id=job.id,
        iteration=iteration,
        source=source,
        tasks=list(tasks),
        options=dict(options),
        status=PENDING,
        submission_id=f"elastron-{job.id}-{eval_id}",
        created_at=time.time(),
    )
    session.add(row)
    add_event(
        session,
        job,
        "eval_requested",
        f"evaluation of iteration {iteration} on {', '.join(tasks)} requested as {eval_id}",
        iteration=iteration,
        data={"eval_id": eval_id, "tasks": list(tasks), "checkpoint": source, **options},
    )
    return row


def get_eval(session: Session, job_id: str, eval_id: str) -> Evaluation | None:
    return session.scalar(select(Evaluation).where(Evaluation.job_id == job_id, Evaluation.id == eval_id))


def finish_eval(
    session: Session, row: Evaluation, status: str, message: str | None, results: dict | None = None
) -> None:
    """Record the end of `row` and the job's event; a second call changes nothing."""
    if row.status not in UNFINISHED:
        return
    row.status, row.message, row.results, row.finished_at = status, message, results, time.time()
    job = session.scalar(select(Job).where(Job.id == row.job_id))
    if job is None:
        return
    if status == SUCCEEDED:
        kind, text = "eval_succeeded", f"evaluated iteration {row.iteration} on {', '.join(row.tasks)}"
    else:
        kind = "eval_failed"
        text = f"evaluation of iteration {row.iteration} failed: {message or 'no message'}"
    add_event(
        session, job, kind, text, iteration=row.iteration, data={"eval_id": row.id, "results": results, "message": message}
    )
