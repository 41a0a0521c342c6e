"""/v1/jobs: submit, list, inspect and cancel jobs; their events, metrics and checkpoints
(exporting a checkpoint: routers/exports.py).

No route here waits on Ray: submitting records a queued job and nudges the reconciler;
cancelling records the request, which the reconciler carries out. (The logs, which do need Ray,
are in routers/logs.py.)
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, HTTPException, Query, Response, status
from sqlalchemy import select
from sqlalchemy.orm import Session, load_only

from service.deps import Caller, Ctx, DbSession, JobId, VisibleJob, not_found
from service.new_jobs import record_new_job
from service.schemas import (
    CheckpointList,
    CheckpointOut,
    EventList,
    EventOut,
    JobList,
    JobOut,
    JobSummary,
    MetricsPage,
    Problem,
)
from service.states import JobState
from service.storage_policy import roots_for
from service.store.db import in_transaction
from service.store.jobs import (
    find_by_idempotency_key,
    get_job,
    new_job_id,
    request_cancel,
)
from service.store.models import Checkpoint, Job, JobEvent, JobMetric
from service.store.tokens import Principal
from service.submission import SpecBody, accept_spec, request_hash

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

AUTH = {401: {"model": Problem, "description": "Missing, invalid or revoked token."}}
NOT_FOUND = {404: {"model": Problem, "description": "No such job among the caller's tenant's jobs."}}

# OpenAPI links from a created job to the operations on it: documentation for clients, and what
# lets a stateful fuzzer (tests/service/test_schemathesis.py) chain a submission to them.
_JOB_ID = {"job_id": "$response.body#/id"}
JOB_LINKS = {
    "GetJob": {"operationId": "get_job_details_v1_jobs__job_id__get", "parameters": _JOB_ID},
    "CancelJob": {"operationId": "cancel_job_v1_jobs__job_id__cancel_post", "parameters": _JOB_ID},
    "JobEvents": {"operationId": "job_events_v1_jobs__job_id__events_get", "parameters": _JOB_ID},
    "JobMetrics": {"operationId": "job_metrics_v1_jobs__job_id__metrics_get", "parameters": _JOB_ID},
    "JobCheckpoints": {
        "operationId": "job_checkpoints_v1_jobs__job_id__checkpoints_get",
        "parameters": _JOB_ID,
    },
    "JobLogs": {"operationId": "job_logs_v1_jobs__job_id__logs_get", "parameters": _JOB_ID},
    "ExportCheckpoint": {"operationId": "export_job_checkpoint", "parameters": _JOB_ID},
    "JobExports": {"operationId": "list_job_exports", "parameters": _JOB_ID},
    "JobExport": {"operationId": "get_job_export", "parameters": _JOB_ID},
    "EvaluateCheckpoint": {"operationId": "evaluate_job_checkpoint", "parameters": _JOB_ID},
    "JobEvals": {"operationId": "list_job_evals", "parameters": _JOB_ID},
    "JobEval": {"operationId": "get_job_eval", "parameters": _JOB_ID},
    "PostTelemetry": {
        "operationId": "post_telemetry_v1_internal_jobs__job_id__telemetry_post",
        "parameters": _JOB_ID,
    },
}

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        description="Retrying a submission with the same key returns the job the first attempt created.",
    ),
]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobOut,
    responses={
        201: {"description": "The job, recorded and queued.", "links": JOB_LINKS},
        **AUTH,
        403: {
            "model": Problem,
            "description": "scheduling.preemptible: false, which the tenant may not use.",
        },
        413: {"model": Problem, "description": "Body over ELASTRON_MAX_BODY_BYTES."},
        422: {
            "model": Problem,
            "description": "The job specification is invalid: one entry per problem, "
            "naming the field and the fix (or an Idempotency-Key reused with another body, a job "
            "that could never fit the cluster or its tenant's quota, or a scheduling.priority above "
            "the tenant's ceiling).",
        },
        429: {
            "model": Problem,
            "description": "Too many submissions (see Retry-After), or the tenant's queued-jobs quota is full.",
        },
    },
)
def submit_job(
    body: Annotated[SpecBody, Body()],
    ctx: Ctx,
    caller: Caller,
    response: Response,
    idempotency_key: IdempotencyKey = None,
) -> JobOut:
    """Validate and record a job; it is launched on Ray as soon as Ray is reachable.

    The body is a job specification (`elastron schema`); the CLI sends YAML files as JSON."""
    # A plain `def`: FastAPI runs it in a worker thread, so reading model.init_from's config.json
    # (S3 too) here holds no other request; on the event loop the body is only parsed as JSON.
    with ctx.sessions() as session:  # the caller's storage roots: checked before anything is read
        roots = roots_for(ctx.settings, session, caller)
    spec = accept_spec(body, roots)
    digest = request_hash(spec)
    if idempotency_key is not None:
        replay = _replay(ctx.sessions, caller, idempotency_key, digest)
        if replay is not None:
            response.headers["Idempotent-Replayed"] = "true"
            response.headers["Location"] = f"/v1/jobs/{replay.id}"
            return replay
    ctx.limits.enforce(caller.tenant, "submit", "submits")  # 429 naming ELASTRON_SUBMIT_RATE_PER_MINUTE
    job_id = new_job_id(spec.name)

    def create(session: Session) -> tuple[JobOut, bool]:
        if idempotency_key is not None:
            existing = find_by_idempotency_key(session, caller.tenant, idempotency_key)
            if existing is not None:  # a concurrent retry won the race
                return _check_replay(existing, digest), True
        job = record_new_job(
            session,
            job_id=job_id,
            caller=caller,
            spec=spec,
            roots=roots,
            settings=ctx.settings,
            capacity=ctx.reconciler.capacity,
            idempotency_key=idempotency_key,
            request_hash=digest,
        )
        return JobOut.from_row(job), False

    out, replayed = in_transaction(ctx.sessions, create)
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    else:
        ctx.reconciler.nudge()
    response.headers["Location"] = f"/v1/jobs/{out.id}"
    return out


def _replay(sessions, caller: Principal, key: str, digest: str) -> JobOut | None:
    with sessions() as session:
        existing = find_by_idempotency_key(session, caller.tenant, key)
        return None if existing is None else _check_replay(existing, digest)


def _check_replay(job: Job, digest: str) -> JobOut:
    if job.request_hash != digest:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail=[
                {
                    "loc": ["header", "Idempotency-Key"],
                    "type": "value_error",
                    "msg": f"Idempotency-Key was already used for job {job.id} with a different job "
                    "specification: use a new key for a new job",
                }
            ],
        )
    return JobOut.from_row(job)


_SUMMARY_COLUMNS = (
    Job.seq,
    Job.id,
    Job.name,
    Job.tenant,
    Job.state,
    Job.created_at,
    Job.updated_at,
    Job.current_iteration,
    Job.train_iters,
    Job.restarts,
    Job.version,
    Job.started_at,
    Job.finished_at,
    Job.spec,
    Job.last_record,
    Job.priority,
    Job.queue_position,
    Job.waiting_reason,
)
# Of jobs.stats, only what progress, ETA and restart time need (service/progress.py): the whole
# column holds histograms and per-rank lists, too much for a page of 500 jobs refreshed every 3 s.
_PROGRESS_STATS = ("recent_steps", "restart_s", "restarting_since")


@router.get("", response_model=JobList, responses=AUTH)
def list_jobs(
    session: DbSession,
    caller: Caller,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
    tenant: Annotated[str | None, Query(max_length=64, description="Admin only: one tenant's jobs.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[
        str | None, Query(pattern=r"^[0-9]{1,18}$", description="next_cursor of the previous page.")
    ] = None,
) -> JobList:
    """The caller's jobs (an admin's: everyone's), newest first."""
    stats = [Job.stats[key] for key in _PROGRESS_STATS]
    query = (
        select(Job, *stats).options(load_only(*_SUMMARY_COLUMNS)).order_by(Job.seq.desc()).limit(limit + 1)
    )
    if not caller.admin:
        query = query.where(Job.tenant == caller.tenant)
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    if state is not None:
        query = query.where(Job.state == state.value)
    if cursor is not None:
        query = query.where(Job.seq < int(cursor))
    rows = session.execute(query).all()
    page = rows[:limit]
    return JobList(
        jobs=[
            JobSummary.from_row(j, {k: v for k, v in zip(_PROGRESS_STATS, values, strict=True) if v is not None})
            for j, *values in page
        ],
        next_cursor=str(page[-1][0].seq) if len(rows) > limit else None,
    )


@router.get("/{job_id}", response_model=JobOut, responses={**AUTH, **NOT_FOUND})
def get_job_details(job: VisibleJob) -> JobOut:
    """Spec, state, timestamps, current iteration, last metrics, restarts, latest checkpoint, failure cause."""
    return JobOut.from_row(job)


@router.post(
    "/{job_id}/cancel",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobOut,
    responses={
        **AUTH,
        **NOT_FOUND,
        200: {
            "model": JobOut,
            "description": "Cancelled (it had not been launched, or was already cancelled).",
        },
        409: {"model": Problem, "description": "The job already succeeded or failed."},
    },
)
def cancel_job(job_id: JobId, ctx: Ctx, caller: Caller, response: Response) -> JobOut:
    """Stop a job. Queued jobs are cancelled at once (200); launched jobs get a graceful stop
    (SIGINT to the driver) from the reconciler and become `cancelled` when Ray confirms (202)."""

    def cancel(session: Session) -> JobOut:
        job = get_job(session, job_id)
        if job is None or not caller.can_see(job.tenant):
            raise not_found(job_id)
        if job.state in (JobState.SUCCEEDED, JobState.FAILED):
            raise HTTPException(
                status.HTTP_409_CONFLICT, detail=f"job {job_id} already {job.state}: nothing to cancel"
            )
        request_cancel(session, job, f"token {caller.token_id}")
        return JobOut.from_row(job)

    out = in_transaction(ctx.sessions, cancel)
    if out.state == JobState.CANCELLED:
        response.status_code = status.HTTP_200_OK
    else:
        ctx.reconciler.nudge()
    return out


@router.get("/{job_id}/events", response_model=EventList, responses={**AUTH, **NOT_FOUND})
def job_events(
    job: VisibleJob,
    session: DbSession,
    after: Annotated[int, Query(ge=0, le=2**62, description="Events with a larger id (next_after).")] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
    kind: Annotated[str | None, Query(max_length=64, description="Only events of this kind.")] = None,
) -> EventList:
    """State changes (with reasons), launches, reconciliations, restarts, rerun diagnoses, checkpoints."""
    query = select(JobEvent).where(JobEvent.job_id == job.id, JobEvent.id > after)
    if kind is not None:
        query = query.where(JobEvent.kind == kind)
    rows = session.scalars(query.order_by(JobEvent.id).limit(limit)).all()
    return EventList(
        events=[EventOut.from_row(e) for e in rows], next_after=rows[-1].id if len(rows) == limit else None
    )


@router.get("/{job_id}/metrics", response_model=MetricsPage, responses={**AUTH, **NOT_FOUND})
def job_metrics(
    job: VisibleJob,
    session: DbSession,
    after: Annotated[
        int, Query(ge=-1, le=2**31 - 1, description="Records with a larger iteration (next_after).")
    ] = -1,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
    max_points: Annotated[
        int | None,
        Query(
            ge=2,
            le=5000,
            description="Downsample: at most this many records, evenly spaced over every record after "
            "`after`, the first and the newest included (for charts; ignores `limit`, no next page).",
        ),
    ] = None,
) -> MetricsPage:
    """The job's per-iteration metrics records, by iteration."""
    if max_points is not None:
        return MetricsPage(records=_downsampled(session, job.id, after, max_points), next_after=None)
    rows = session.execute(
        select(JobMetric.iteration, JobMetric.record)
        .where(JobMetric.job_id == job.id, JobMetric.iteration > after)
        .order_by(JobMetric.iteration)
        .limit(limit)
    ).all()
    return MetricsPage(records=[r for _, r in rows], next_after=rows[-1][0] if len(rows) == limit else None)


def _downsampled(session: Session, job_id: str, after: int, max_points: int) -> list[dict]:
    """Every record when there are few; else `max_points` picked evenly by position. Only the
    iterations are read to choose, then only the chosen records: a 10,000-step job costs one
    integer column scan and `max_points` rows, not 10,000 records on the wire."""
    iterations = session.scalars(
        select(JobMetric.iteration)
        .where(JobMetric.job_id == job_id, JobMetric.iteration > after)
        .order_by(JobMetric.iteration)
    ).all()
    if len(iterations) > max_points:
        last = len(iterations) - 1
        iterations = sorted({iterations[round(i * last / (max_points - 1))] for i in range(max_points)})
    records: list[dict] = []
    for start in range(0, len(iterations), 500):  # bounded IN lists
        chunk = iterations[start : start + 500]
        records += session.scalars(
            select(JobMetric.record)
            .where(JobMetric.job_id == job_id, JobMetric.iteration.in_(chunk))
            .order_by(JobMetric.iteration)
        ).all()
    return records


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, responses={**AUTH, **NOT_FOUND})
def job_checkpoints(
    job: VisibleJob, session: DbSession, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> CheckpointList:
    """Checkpoint saves the workers reported (newest `limit`, oldest first), failures included."""
    rows = session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.id.desc()).limit(limit)
    ).all()
    return CheckpointList(checkpoints=[CheckpointOut.from_row(c) for c in reversed(rows)])
