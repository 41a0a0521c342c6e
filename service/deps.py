"""FastAPI dependencies: the app context, the store session, the caller, the caller's job."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy.orm import Session

from service.auth import INVALID, MISSING, bearer, unauthorized
from service.context import AppContext
from service.store.jobs import get_job
from service.store.models import Job
from service.store.tokens import Principal


def get_ctx(request: Request) -> AppContext:
    return request.app.state.ctx


Ctx = Annotated[AppContext, Depends(get_ctx)]


def get_session(ctx: Ctx) -> Iterator[Session]:
    with ctx.sessions() as session:
        yield session


DbSession = Annotated[Session, Depends(get_session)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def get_principal(ctx: Ctx, credentials: Credentials) -> Principal:
    if credentials is None:
        raise unauthorized(MISSING)
    principal = ctx.tokens.lookup(credentials.credentials)
    if principal is None:
        raise unauthorized(INVALID)
    return principal


Caller = Annotated[Principal, Depends(get_principal)]
JobId = Annotated[str, Path(min_length=1, max_length=96, description="The job id returned at submission.")]


def not_found(job_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no job {job_id!r}")


def visible_job(session: DbSession, caller: Caller, job_id: JobId) -> Job:
    """The job, if the caller's tenant owns it (or the caller is admin); 404 otherwise, so a
    tenant cannot even learn that another tenant's job id exists."""
    job = get_job(session, job_id)
    if job is None or not caller.can_see(job.tenant):
        raise not_found(job_id)
    return job


VisibleJob = Annotated[Job, Depends(visible_job)]
