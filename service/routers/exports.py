"""/v1/jobs/{id}/checkpoints/{iteration}/export and /v1/jobs/{id}/exports: a job's committed
checkpoint as a Hugging Face model folder, or a LoRA job's adapters as a PEFT folder (or merged).

A request records the export (status `pending`, the job's `export_requested` event) and nudges
the reconciler, which submits `elastron export` as its own launcher submission (a Ray job: it
reads the whole checkpoint and can take minutes) and records how it ends. The reads serve the
store as the reconciler last refreshed it (every ELASTRON_RECONCILE_INTERVAL_S): no request
waits on Ray, and an export's end is recorded as a job event whether or not anyone asks. What
may be read and written, and why: service/exports.py.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Response, status
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.deps import Caller, Ctx, DbSession, JobId, VisibleJob, not_found
from service.export_limits import check_export_limits, identical_export
from service.exports import OutputProblem, checkpoint_folder, format_problem, resolve_output
from service.routers.jobs import AUTH, NOT_FOUND
from service.schemas import ITERATION_MAX, ExportIn, ExportList, ExportOut, Problem
from service.storage_policy import tenant_roots
from service.store.db import in_transaction
from service.store.exports import create_export, get_export
from service.store.jobs import get_job
from service.store.models import Checkpoint, Export, Job

router = APIRouter(prefix="/v1/jobs", tags=["exports"])

IterationPath = Annotated[
    int, Path(ge=0, le=ITERATION_MAX, description="The checkpoint's iteration (GET .../checkpoints).")
]
ExportId = Annotated[str, Path(min_length=1, max_length=40, description="The export's id (exp-...).")]


def committed_checkpoint(session: Session, caller, job_id: str, iteration: int, nothing: str) -> tuple[Job, str]:
    """(the job, the folder its checkpoint of `iteration` is in) for a command that reads it (an
    export, an evaluation): 404 for a job the caller cannot see or an iteration it did not save,
    409 for a failed save (`nothing`: what that leaves, e.g. "nothing to export") or a job
    without checkpoint.path."""
    job = get_job(session, job_id)
    if job is None or not caller.can_see(job.tenant):
        raise not_found(job_id)
    saved = session.scalar(
        select(Checkpoint)
        .where(Checkpoint.job_id == job.id, Checkpoint.iteration == iteration)
        .order_by(Checkpoint.id.desc())
        .limit(1)
    )
    if saved is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            detail=f"job {job_id} has no checkpoint at iteration {iteration} "
            "(GET /v1/jobs/{job_id}/checkpoints lists those it saved)",
        )
    if saved.result != "success":
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            detail=f"the checkpoint save of job {job_id} at iteration {iteration} failed: "
            f"{nothing}; choose another iteration",
        )
    source = checkpoint_folder(job.spec, job.id, iteration)
    if source is None:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            detail=f"job {job_id} has no checkpoint.path: the service cannot tell where it saved",
        )
    return job, source


@router.post(
    "/{job_id}/checkpoints/{iteration}/export",
    operation_id="export_job_checkpoint",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=ExportOut,
    responses={
        **AUTH,
        404: {
            "model": Problem,
            "description": "No such job among the caller's tenant's jobs, or no successful checkpoint "
            "of it at this iteration.",
        },
        200: {"model": ExportOut, "description": "The same export was already asked for: that export."},
        409: {"model": Problem, "description": "The checkpoint save at this iteration failed."},
        422: {"model": Problem, "description": "A bad format, dtype or output, naming the field."},
        429: {
            "model": Problem,
            "description": "Too many exports in flight for the tenant or the checkpoint, or asked for "
            "too fast (see Retry-After).",
        },
    },
)
def export_job_checkpoint(
    job_id: JobId, iteration: IterationPath, body: ExportIn, ctx: Ctx, caller: Caller, response: Response
) -> ExportOut:
    """Export the job's committed checkpoint of `iteration` (its `elastron export`), in the
    background: 202 with the export, `pending`; follow it at GET .../exports/{export_id}.
    The same request as an export pending, running or succeeded: 200 with that export. Limits
    on exports in flight: service/export_limits.py."""
    ctx.limits.enforce(caller.tenant, "export", "asks for exports")  # ELASTRON_EXPORT_RATE_PER_MINUTE

    def record(session: Session) -> ExportOut:
        job, source = committed_checkpoint(session, caller, job_id, iteration, "nothing to export")
        problem = format_problem(job.spec, body.format)
        if problem is not None:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                detail=[{"loc": ["body", "format"], "msg": problem, "type": "value_error"}],
            )
        try:
            roots = None if caller.admin else tenant_roots(ctx.settings, session, job.tenant)
            output = resolve_output(body.output, source, ctx.settings, job.tenant, body.format, roots)
        except OutputProblem as err:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                detail=[{"loc": ["body", "output"], "msg": str(err), "type": "value_error"}],
            ) from None
        same = identical_export(session, job.id, iteration, body.format, body.dtype, output)
        if same is not None:  # a retry, or the same request twice: the export already asked for
            response.status_code = status.HTTP_200_OK
            return ExportOut.from_row(same)
        check_export_limits(session, job, iteration, ctx.settings)
        export = create_export(
            session,
            job,
            iteration=iteration,
            format=body.format,
            dtype=body.dtype,
            source=source,
            output=output,
        )
        session.flush()
        return ExportOut.from_row(export)

    out = in_transaction(ctx.sessions, record)
    ctx.reconciler.nudge()
    return out


@router.get(
    "/{job_id}/exports",
    operation_id="list_job_exports",
    response_model=ExportList,
    responses={**AUTH, **NOT_FOUND},
)
def list_job_exports(
    job: VisibleJob, session: DbSession, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> ExportList:
    """The job's exports (newest `limit`, oldest first) with their status, as the reconciler last
    saw them from the launcher."""
    rows = session.scalars(
        select(Export).where(Export.job_id == job.id).order_by(Export.created_at.desc()).limit(limit)
    ).all()
    return ExportList(exports=[ExportOut.from_row(e) for e in reversed(rows)])


@router.get(
    "/{job_id}/exports/{export_id}",
    operation_id="get_job_export",
    response_model=ExportOut,
    responses={**AUTH, 404: {"model": Problem, "description": "No such job, or no such export of it."}},
)
def get_job_export(job: VisibleJob, session: DbSession, export_id: ExportId) -> ExportOut:
    """One export: status (pending, running, succeeded, failed), message, output."""
    export = get_export(session, job.id, export_id)
    if export is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job.id} has no export {export_id!r}")
    return ExportOut.from_row(export)
