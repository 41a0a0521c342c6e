"""The scheduler's surface: `GET /v1/queue` (waiting jobs in order, with why each waits, and the
cluster's use) and the tenants' quotas (`GET`/`PUT /v1/tenants/{tenant}/quota`; setting one is
for admins). Nothing here talks to Ray: the queue's order and reasons are what the reconciler's
last scheduling pass wrote on the job rows, the cluster what it last read.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, status
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.deps import Caller, Ctx, DbSession
from service.schemas import ClusterUse, Problem, QueueEntry, QueueOut, QuotaIn, QuotaOut, _layout, stored_time
from service.states import JobState
from service.store.db import in_transaction
from service.store.models import Job, TenantQuota
from service.store.tokens import TENANT_PATTERN

router = APIRouter(tags=["scheduling"])

AUTH = {401: {"model": Problem, "description": "Missing, invalid or revoked token."}}
Tenant = Annotated[
    str, Path(min_length=1, max_length=64, pattern=TENANT_PATTERN.pattern, description="The tenant's name.")
]


@router.get("/v1/queue", response_model=QueueOut, responses=AUTH)
def queue(
    session: DbSession,
    ctx: Ctx,
    caller: Caller,
    tenant: Annotated[str | None, Query(max_length=64, description="Admin only: one tenant's jobs.")] = None,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> QueueOut:
    """Waiting jobs in the scheduler's order (the caller's own; an admin's: everyone's), each with
    why it waits; and the cluster's capacity against what is allocated, as last read."""
    query = (
        select(
            Job.id,
            Job.name,
            Job.tenant,
            Job.priority,
            Job.spec,
            Job.queue_position,
            Job.waiting_reason,
            Job.queued_at,
            Job.created_at,
            Job.waited_s,
        )
        .where(Job.state == JobState.QUEUED.value, Job.submission_id.is_(None), Job.cancel_requested_at.is_(None))
        .order_by(Job.queue_position.is_(None), Job.queue_position, Job.seq)
        .limit(limit)
    )
    if not caller.admin:
        query = query.where(Job.tenant == caller.tenant)
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    now = time.time()
    entries = []
    for r in session.execute(query).all():
        since = r.queued_at if r.queued_at is not None else r.created_at
        entries.append(
            QueueEntry(
                position=r.queue_position,
                id=r.id,
                name=r.name,
                tenant=r.tenant,
                priority=r.priority or 0,
                ranks=_layout(r.spec)[0],
                waiting_reason=r.waiting_reason,
                queued_since=stored_time(since),
                waited_s=(r.waited_s or 0.0) + max(0.0, now - since),
            )
        )
    rec = ctx.reconciler
    cluster = None
    if rec.capacity is not None:
        alive = [n for n in rec.capacity if n.alive]
        cluster = ClusterUse(
            nodes=len(alive),
            cpus=sum(n.cpus for n in alive),
            gpus=sum(n.gpus for n in alive),
            allocated_cpus=rec.scheduling.allocated[0],
            allocated_gpus=rec.scheduling.allocated[1],
            read_at=stored_time(rec.capacity_at),
        )
    return QueueOut(jobs=entries, cluster=cluster)


def _out(tenant: str, row: TenantQuota | None) -> QuotaOut:
    if row is None:
        return QuotaOut(tenant=tenant, updated_at=None)
    return QuotaOut(
        tenant=tenant,
        ranks=row.ranks,
        gpus=row.gpus,
        cpus=row.cpus,
        queued=row.queued,
        max_priority=row.max_priority,
        allow_non_preemptible=row.allow_non_preemptible,
        updated_at=stored_time(row.updated_at),
    )


@router.get(
    "/v1/tenants/{tenant}/quota",
    response_model=QuotaOut,
    responses={**AUTH, 404: {"model": Problem, "description": "Another tenant's quota (admins see all)."}},
)
def get_quota(tenant: Tenant, session: DbSession, caller: Caller) -> QuotaOut:
    """A tenant's limits (null: unlimited); a tenant reads its own, an admin any."""
    if not caller.can_see(tenant):
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no quota of tenant {tenant!r} for you to see")
    return _out(tenant, session.get(TenantQuota, tenant))


@router.put(
    "/v1/tenants/{tenant}/quota",
    response_model=QuotaOut,
    responses={**AUTH, 403: {"model": Problem, "description": "Not an admin token."}},
)
def set_quota(tenant: Tenant, body: QuotaIn, ctx: Ctx, caller: Caller) -> QuotaOut:
    """Set a tenant's limits (admins only): the whole quota, absent fields unlimited. Running jobs
    are not stopped by a lower quota; queued ones wait (with that reason) until they fit it."""
    if not caller.admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="setting a tenant's quota needs an admin token")

    def put(session: Session) -> QuotaOut:
        row = session.get(TenantQuota, tenant)
        if row is None:
            row = TenantQuota(tenant=tenant)
            session.add(row)
        for field, value in body.model_dump().items():
            setattr(row, field, value)
        row.updated_at = time.time()
        session.flush()
        return _out(tenant, row)

    out = in_transaction(ctx.sessions, put)
    ctx.reconciler.nudge()
    return out
