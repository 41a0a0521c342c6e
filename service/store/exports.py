"""Export rows: creation (with the job's `export_requested` event) and their end (with
`export_succeeded` / `export_failed`), each in the caller's transaction, so the job's events
always agree with the export's status."""

from __future__ import annotations

import secrets
import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.store.jobs import add_event
from service.store.models import Export, Job

PENDING, RUNNING, SUCCEEDED, FAILED = "pending", "running", "succeeded", "failed"
UNFINISHED = (PENDING, RUNNING)


def create_export(
    session: Session, job: Job, *, iteration: int, format: str, dtype: str, source: str, output: str
) -> Export:
    export_id = f"exp-{secrets.token_hex(6)}"
    export = Export(
        id=export_id,
        job_id=job.id,
        iteration=iteration,
        format=format,
        dtype=dtype,
        source=source,
        output=output,
        status=PENDING,
        submission_id=f"elastron-{job.id}-{export_id}",
        created_at=time.time(),
    )
    session.add(export)
    add_event(
        session,
        job,
        "export_requested",
        f"export of iteration {iteration} to {output} ({format}, {dtype}) requested as {export_id}",
        iteration=iteration,
        data={
            "export_id": export_id,
            "output": output,
            "format": format,
            "dtype": dtype,
            "checkpoint": source,
        },
    )
    return export


def get_export(session: Session, job_id: str, export_id: str) -> Export | None:
    return session.scalar(select(Export).where(Export.job_id == job_id, Export.id == export_id))


def finish_export(session: Session, export: Export, status: str, message: str | None) -> None:
    """Record the end of `export` and the job's event; a second call changes nothing."""
    if export.status not in UNFINISHED:
        return
    export.status, export.message, export.finished_at = status, message, time.time()
    job = session.scalar(select(Job).where(Job.id == export.job_id))
    if job is None:
        return
    kind = "export_succeeded" if status == SUCCEEDED else "export_failed"
    text = f"exported iteration {export.iteration} to {export.output}"
    if status != SUCCEEDED:
        text = f"export of iteration {export.iteration} to {export.output} failed: {message or 'no message'}"
    add_event(
        session,
        job,
        kind,
        text,
        iteration=export.iteration,
        data={"export_id": export.id, "output": export.output, "message": message},
    )
