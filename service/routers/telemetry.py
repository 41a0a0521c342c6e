"""/v1/internal/jobs/{job_id}/telemetry: metrics records and events from a job's workers.

Accepted credentials: the job's own token (minted per launch attempt and passed to the workers
as ELASTRON_API_TOKEN; it is good for this one job's telemetry and nothing else), or an admin
token (for replaying a job's records by hand). A user token is refused (403), its own tenant's
job included: telemetry decides a job's state, metrics and events, and a user who could post it
could forge them. Users have no need to: their workers hold the job token.

A job token of an attempt the control plane has given up on (service/fencing.py) is refused with
409 and the code `attempt_fenced`: that attempt is an orphan and its workers stop at once, with
no further checkpoint (workers/fencing.py). A token no attempt was given stays a 401. The workers
also send their attempt's fencing token (X-Elastron-Fencing-Token); one that is not the job's
current one is refused the same way.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, status
from sqlalchemy.orm import Session

from engine.jobspec import contract
from service.auth import INVALID, MISSING, unauthorized
from service.deps import Credentials, Ctx, JobId, not_found
from service.fencing import stale_attempt
from service.schemas import Problem, TelemetryAck, TelemetryIn
from service.states import JobState
from service.store.db import in_transaction
from service.store.jobs import get_job
from service.store.telemetry import ingest, live_target
from service.store.tokens import JOB_PREFIX, hash_secret

router = APIRouter(tags=["internal"])


@router.post(
    contract.TELEMETRY_PATH,  # the workers post to the same name (engine/jobspec/contract.py)
    response_model=TelemetryAck,
    responses={
        401: {"model": Problem},
        403: {"model": Problem, "description": "A user token: only the job token or an admin token may post."},
        404: {"model": Problem},
        409: {
            "model": Problem,
            "description": "attempt_fenced: the token or fencing token is of an attempt the control plane "
            "gave up on (a newer attempt runs); the workers stop without saving.",
        },
        413: {"model": Problem},
        422: {"model": Problem, "description": "A field out of its bounds (named), or a malformed batch."},
    },
)
def post_telemetry(
    job_id: JobId,
    body: TelemetryIn,
    ctx: Ctx,
    credentials: Credentials,
    fencing_token: Annotated[int | None, Header(alias=contract.FENCING_HEADER)] = None,
) -> TelemetryAck:
    """Ingest a batch (service/METRICS.md): idempotent, so the workers may resend after any error."""
    if credentials is None:
        raise unauthorized(MISSING)
    secret = credentials.credentials
    principal = None if secret.startswith(JOB_PREFIX) else ctx.tokens.lookup(secret)
    if principal is None and not secret.startswith(JOB_PREFIX):
        raise unauthorized(INVALID)
    records = [r.model_dump(mode="python", exclude_unset=True) for r in body.records]
    events = [e.model_dump(mode="python", exclude_unset=True) for e in body.events]

    def apply(session: Session) -> TelemetryAck:
        job = get_job(session, job_id)
        if job is None:
            raise not_found(job_id)
        if principal is None:
            expected, presented = job.telemetry_token_hash or "", hash_secret(secret)
            if not hmac.compare_digest(expected, presented):
                fence = stale_attempt(session, job_id, presented)
                if fence is not None:
                    raise fenced(job_id, fence.fencing_token, job.fencing_token, fence.reason)
                raise unauthorized(
                    f"this token is not valid for job {job_id!r} (a job token only works for the "
                    "launch attempt it was made for)"
                )
            if fencing_token is not None and fencing_token != job.fencing_token:
                raise fenced(job_id, fencing_token, job.fencing_token, "not the current attempt")
        elif not principal.can_see(job.tenant):
            raise not_found(job_id)
        elif not principal.admin:
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                detail=f"job {job_id}'s telemetry is written by its workers (the job token they are "
                "given) or with an admin token; a user token may only read it",
            )
        result = ingest(session, job, records, events)
        preempting = job.preempt_requested_at is not None and job.cancel_requested_at is None
        return TelemetryAck(
            **vars(result),
            state=JobState(job.state),
            stop="checkpoint" if preempting else None,
            replicas=live_target(job),
        )

    return in_transaction(ctx.sessions, apply)


def fenced(job_id: str, token: int, current: int, why: str) -> HTTPException:
    return HTTPException(
        status.HTTP_409_CONFLICT,
        detail=[
            {
                "type": contract.FENCED_CODE,
                "loc": ["header", contract.FENCING_HEADER],
                "msg": f"job {job_id}: this attempt (fencing token {token}) was given up on ({why}); the "
                f"current attempt has fencing token {current}. Stop this attempt without saving a checkpoint",
                "fencing_token": token,
                "current_fencing_token": current,
            }
        ],
    )
