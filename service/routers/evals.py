"""/v1/jobs/{id}/checkpoints/{iteration}/evals and /v1/jobs/{id}/evals: lm-eval's shipped tasks on
a job's committed checkpoint, on the layout asked for, without exporting it.

A request records the evaluation (status `pending`, the job's `eval_requested` event) and nudges
the reconciler, which submits `elastron eval` as its own launcher submission (a Ray job: it
loads the whole model) and records how it ended, with the scores it reported
(service/eval_runs.py). The checkpoint read is the one an export would read; the tasks are the
shipped ones only (service/schemas_evals.py); it writes nothing. The same request as one pending,
running or succeeded answers with that evaluation (200), and a tenant has at most as many
evaluations in flight as exports (ELASTRON_MAX_EXPORTS_PER_TENANT).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Response, status
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.deps import Caller, Ctx, DbSession, JobId, VisibleJob
from service.routers.exports import IterationPath, committed_checkpoint
from service.routers.jobs import AUTH, NOT_FOUND
from service.schemas import Problem
from service.schemas_evals import EvalIn, EvalList, EvalOut
from service.store.db import in_transaction
from service.store.evals import UNFINISHED, create_eval, get_eval, identical_eval
from service.store.models import Evaluation, Job

router = APIRouter(prefix="/v1/jobs", tags=["evals"])

EvalId = Annotated[str, Path(min_length=1, max_length=40, description="The evaluation's id (eval-...).")]


@router.post(
    "/{job_id}/checkpoints/{iteration}/evals",
    operation_id="evaluate_job_checkpoint",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=EvalOut,
    responses={
        **AUTH,
        404: {"model": Problem, "description": "No such job among the caller's tenant's jobs, or no checkpoint of it at this iteration."},
        200: {"model": EvalOut, "description": "The same evaluation was already asked for: that one."},
        409: {"model": Problem, "description": "The checkpoint save at this iteration failed."},
        422: {"model": Problem, "description": "An unknown task or a bad layout or limit, naming the field."},
        429: {"model": Problem, "description": "Too many evaluations in flight for the tenant, or asked for too fast."},
    },
)
def evaluate_job_checkpoint(
    job_id: JobId, iteration: IterationPath, body: EvalIn, ctx: Ctx, caller: Caller, response: Response
) -> EvalOut:
    """Evaluate the job's committed checkpoint of `iteration` (its `elastron eval`) in the
    background: 202 with the evaluation, `pending`; its scores at GET .../evals/{eval_id}."""
    ctx.limits.enforce(caller.tenant, "export", "asks for exports or evaluations")  # ELASTRON_EXPORT_RATE_PER_MINUTE

    def record(session: Session) -> EvalOut:
        job, source = committed_checkpoint(session, caller, job_id, iteration, "nothing to evaluate")
        same = identical_eval(session, job.id, iteration, body.tasks, body.options())
        if same is not None:  # a retry, or the same request twice
            response.status_code = status.HTTP_200_OK
            return EvalOut.from_row(same)
        _check_in_flight(session, job, ctx.settings.max_exports_per_tenant)
        row = create_eval(session, job, iteration=iteration, source=source, tasks=body.tasks, options=body.options())
        session.flush()
        return EvalOut.from_row(row)

    out = in_transaction(ctx.sessions, record)
    ctx.reconciler.nudge()
    return out


def _check_in_flight(session: Session, job: Job, most: int) -> None:
    running = session.scalar(
        select(func.count())
        .select_from(Evaluation)
        .join(Job, Job.id == Evaluation.job_id)
        .where(Job.tenant == job.tenant, Evaluation.status.in_(UNFINISHED))
    )
    if running >= most:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            detail=f"tenant {job.tenant} has {running} evaluations pending or running (at most {most}, "
            "ELASTRON_MAX_EXPORTS_PER_TENANT): wait for one to end",
            headers={"Retry-After": "30"},
        )


@router.get("/{job_id}/evals", operation_id="list_job_evals", response_model=EvalList, responses={**AUTH, **NOT_FOUND})
def list_job_evals(job: VisibleJob, session: DbSession, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> EvalList:
    """The job's evaluations (newest `limit`, oldest first), with their scores once succeeded."""
    rows = session.scalars(
        select(Evaluation).where(Evaluation.job_id == job.id).order_by(Evaluation.created_at.desc()).limit(limit)
    ).all()
    return EvalList(evals=[EvalOut.from_row(r) for r in reversed(rows)])


@router.get(
    "/{job_id}/evals/{eval_id}",
    operation_id="get_job_eval",
    response_model=EvalOut,
    responses={**AUTH, 404: {"model": Problem, "description": "No such job, or no such evaluation of it."}},
)
def get_job_eval(job: VisibleJob, session: DbSession, eval_id: EvalId) -> EvalOut:
    """One evaluation: status (pending, running, succeeded, failed), scores, message."""
    row = get_eval(session, job.id, eval_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job.id} has no evaluation {eval_id!r}")
    return EvalOut.from_row(row)
