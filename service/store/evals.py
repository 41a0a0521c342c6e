"""Evaluation rows: creation (with the job's `eval_requested` event) and their end (with
`eval_succeeded` / `eval_failed`), each in the caller's transaction, so the job's events always
agree with the evaluation's status."""

from __future__ import annotations

import secrets
import time
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from engine.jobspec.evaluation import OnCheckpointSpec
from service.exports import checkpoint_folder
from service.store.exports import FAILED, PENDING, RUNNING, SUCCEEDED, UNFINISHED
from service.store.jobs import add_event
from service.store.models import Checkpoint, Evaluation, Job

__all__ = [
    "FAILED",
    "PENDING",
    "RUNNING",
    "SUCCEEDED",
    "UNFINISHED",
    "create_eval",
    "evaluations_on_checkpoint",
    "finish_eval",
    "get_eval",
    "identical_eval",
]


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


def identical_eval(
    session: Session, job_id: str, iteration: int, tasks: list[str], options: dict[str, Any]
) -> Evaluation | None:
    """The evaluation of this checkpoint already asked for with these tasks and options, pending,
    running or succeeded (a failed one may be asked for again)."""
    rows = session.scalars(
        select(Evaluation).where(
            Evaluation.job_id == job_id,
            Evaluation.iteration == iteration,
            Evaluation.status.in_((*UNFINISHED, SUCCEEDED)),
        )
    ).all()
    return next((r for r in rows if r.tasks == list(tasks) and r.options == dict(options)), None)


def evaluations_on_checkpoint(session: Session, job: Job, iteration: int) -> Evaluation | None:
    """The job spec's evaluation.on_checkpoint for the checkpoint of `iteration` just recorded
    (in the same transaction: one evaluation per checkpoint, whatever crashes): every `every`-th
    committed checkpoint of the job gets one, unless the same was asked for already."""
    asked = (job.spec.get("evaluation") or {}).get("on_checkpoint")
    if not asked:
        return None
    spec = OnCheckpointSpec.model_validate(asked)
    committed = session.scalar(
        select(func.count())
        .select_from(Checkpoint)
        .where(Checkpoint.job_id == job.id, Checkpoint.result == "success", Checkpoint.iteration <= iteration)
    )
    source = checkpoint_folder(job.spec, job.id, iteration)
    if committed % spec.every or source is None:
        return None
    if identical_eval(session, job.id, iteration, spec.tasks, spec.options()) is not None:
        return None
    return create_eval(session, job, iteration=iteration, source=source, tasks=spec.tasks, options=spec.options())


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
