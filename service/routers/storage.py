"""A tenant's storage grants: `GET`/`PUT /v1/tenants/{tenant}/storage`.

Beyond its defaults (`<checkpoint root>/<tenant>/`, `<home>/exports/<tenant>/`, the operator's
ELASTRON_SHARED_READ_ROOTS) a tenant's jobs and exports may use only the roots an admin grants
here (service/storage_policy.py). Setting them needs an admin token; a tenant reads its own.
Jobs already admitted keep the roots they were admitted with.
"""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, HTTPException, status
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from service.deps import Caller, Ctx, DbSession
from service.routers.scheduling import AUTH, Tenant
from service.schemas import Problem, stored_time
from service.storage_policy import default_roots, grants, set_grants
from service.store.db import in_transaction

router = APIRouter(tags=["scheduling"])


class StorageIn(BaseModel):
    roots: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Roots the tenant's jobs and exports may read and write: absolute local paths or "
        "s3://bucket[/prefix] (the whole list: roots left out are revoked).",
    )
    read_roots: list[str] = Field(
        default_factory=list, max_length=64, description="Roots the tenant's jobs may only read."
    )


class StorageOut(BaseModel):
    tenant: str
    default_roots: list[str] = Field(description="Always allowed: its checkpoint and export folders.")
    roots: list[str] = Field(description="Granted read-write roots.")
    read_roots: list[str] = Field(description="Granted read-only roots.")
    shared_read_roots: list[str] = Field(
        description="Read-only roots of every tenant (ELASTRON_SHARED_READ_ROOTS)."
    )
    updated_at: datetime | None = None


def _out(ctx: Ctx, session: Session, tenant: str) -> StorageOut:
    row = grants(session, tenant)
    return StorageOut(
        tenant=tenant,
        default_roots=default_roots(ctx.settings, tenant),
        roots=list(row.roots) if row else [],
        read_roots=list(row.read_roots) if row else [],
        shared_read_roots=list(ctx.settings.shared_read_roots),
        updated_at=stored_time(row.updated_at) if row else None,
    )


@router.get(
    "/v1/tenants/{tenant}/storage",
    response_model=StorageOut,
    responses={**AUTH, 404: {"model": Problem, "description": "Another tenant's storage (admins see all)."}},
)
def get_storage(tenant: Tenant, ctx: Ctx, session: DbSession, caller: Caller) -> StorageOut:
    """The storage roots a tenant's jobs and exports may use; a tenant reads its own, an admin any."""
    if not caller.can_see(tenant):
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, detail=f"no storage of tenant {tenant!r} for you to see"
        )
    return _out(ctx, session, tenant)


@router.put(
    "/v1/tenants/{tenant}/storage",
    response_model=StorageOut,
    responses={
        **AUTH,
        403: {"model": Problem, "description": "Not an admin token."},
        422: {
            "model": Problem,
            "description": "A root that is not an absolute path or s3://bucket[/prefix].",
        },
    },
)
def put_storage(tenant: Tenant, body: StorageIn, ctx: Ctx, caller: Caller) -> StorageOut:
    """Grant a tenant storage roots (admins only): the whole list, replacing the previous grant."""
    if not caller.admin:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, detail="granting a tenant storage needs an admin token"
        )

    def put(session: Session) -> StorageOut:
        try:
            set_grants(session, tenant, body.roots, body.read_roots)
        except ValueError as err:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                detail=[{"loc": ["body", "roots"], "msg": str(err), "type": "value_error"}],
            ) from None
        session.flush()
        return _out(ctx, session, tenant)

    return in_transaction(ctx.sessions, put)
