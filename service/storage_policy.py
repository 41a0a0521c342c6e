"""Per-tenant storage confinement: the roots a tenant's jobs and exports may use.

Jobs and exports run with the service's storage rights, so every path, bucket and endpoint a
tenant names is checked here, at submission, BEFORE anything reads it (accept_spec reads
model.init_from's config.json: that read would itself be the leak), against:
- write (and read): `<checkpoint root>/<tenant>/` (ELASTRON_CHECKPOINT_DIR, local or s3://),
  `<home>/exports/<tenant>/`, and the roots an admin granted (`elastron tenants set-storage`);
- read only: ELASTRON_SHARED_READ_ROOTS (e.g. the operator's datasets) and granted read roots;
- `checkpoint.endpoint_url`: only ELASTRON_ALLOWED_ENDPOINTS (never the metadata address).
Outside: 422 naming the field and the roots. Admins' submissions are not confined (their jobs
run unconfined too). The decision is recorded per job (`job_storage`) and given to its workers
at each launch in ELASTRON_STORAGE_ROOTS, where engine/jobspec/storage_roots.py (the same matching
code) checks again as storage is opened. Tenants with credentials in ELASTRON_TENANT_CREDENTIALS
get those in their jobs' and exports' environment instead of the service's own.
"""

from __future__ import annotations

import os
import time
from typing import Any

from sqlalchemy.orm import Session

from engine.jobspec.layout import join_location
from engine.jobspec.storage_roots import (
    ENV_STORAGE_ROOTS,
    StorageRoots,
    joined,
    normalize,
    normalize_endpoint,
    outside_message,
    spec_problems,
)
from service.settings import Settings
from service.store.jobs import get_job
from service.store.models import JobStorage, TenantStorage
from service.store.tokens import Principal

# Link-local cloud metadata (AWS/GCP/Azure), its IPv6 form and common names: never an endpoint.
METADATA_HOSTS = ("169.254.169.254", "[fd00:ec2::254]", "metadata.google.internal", "metadata")


def default_roots(settings: Settings, tenant: str) -> list[str]:
    return [
        join_location(settings.resolved_checkpoint_dir, tenant),
        os.path.abspath(settings.exports_dir / tenant),
    ]


def grants(session: Session, tenant: str) -> TenantStorage | None:
    return session.get(TenantStorage, tenant)


def tenant_roots(settings: Settings, session: Session, tenant: str) -> StorageRoots:
    """Everything `tenant` may use now: defaults, its grants, the shared read roots, the endpoints."""
    row = grants(session, tenant)
    endpoints = tuple(e for e in settings.allowed_endpoints if not _metadata(e))
    return StorageRoots(
        write=joined([*default_roots(settings, tenant), *(row.roots if row else [])]),
        read=joined([*settings.shared_read_roots, *(row.read_roots if row else [])]),
        endpoints=endpoints,
    )


def roots_for(settings: Settings, session: Session, caller: Principal) -> StorageRoots | None:
    """The caller's roots; None for an admin (unconfined)."""
    return None if caller.admin else tenant_roots(settings, session, caller.tenant)


def _metadata(url: str) -> bool:
    host = normalize_endpoint(url).split("://", 1)[-1].split("/", 1)[0]
    host = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return host in METADATA_HOSTS


def body_problems(body: Any, roots: StorageRoots | None) -> list[tuple[str, str]]:
    """(field, message) for each location of a raw submitted spec outside `roots` (None: none)."""
    if roots is None or not isinstance(body, dict):
        return []
    return spec_problems(body, roots)


def record_job_roots(session: Session, job_id: str, tenant: str, roots: StorageRoots | None) -> None:
    session.add(
        JobStorage(
            job_id=job_id,
            tenant=tenant,
            roots=None
            if roots is None
            else {"write": list(roots.write), "read": list(roots.read), "endpoints": list(roots.endpoints)},
        )
    )


def job_roots(settings: Settings, session: Session, job_id: str, tenant: str) -> StorageRoots | None:
    """The roots a job was admitted with; None only for an admin's job (recorded unconfined). A
    job without a record was submitted before confinement existed: it gets its tenant's roots
    as they are now, so an upgrade leaves no job unconfined (one that named a path outside them
    stops at its start with the path and the roots named, instead of reading it)."""
    row = session.get(JobStorage, job_id)
    if row is None:
        return tenant_roots(settings, session, tenant)
    if row.roots is None:
        return None
    r = row.roots
    return StorageRoots(
        tuple(r.get("write") or ()), tuple(r.get("read") or ()), tuple(r.get("endpoints") or ())
    )


def credentials_env(settings: Settings, tenant: str) -> dict[str, str]:
    """The tenant's storage credentials as environment variables (empty: the service's own chain).
    A value `$NAME` is read from this process's variable NAME."""
    out = {}
    for key, value in (settings.tenant_credentials.get(tenant) or {}).items():
        if value.startswith("$"):
            value = os.environ.get(value[1:], "")
        out[key] = value
    return out


def launch_env(settings: Settings, session: Session, job_id: str) -> dict[str, str]:
    """What a job's workers get on top of worker_env: its roots and its tenant's credentials."""
    job = get_job(session, job_id)
    if job is None:
        return {}
    env = credentials_env(settings, job.tenant)
    roots = job_roots(settings, session, job_id, job.tenant)
    if roots is not None:
        env[ENV_STORAGE_ROOTS] = roots.to_env()
    return env


def export_env(settings: Settings, session: Session, job_id: str, tenant: str, output: str) -> dict[str, str]:
    """An export's environment: the tenant's credentials and, for a confined job, the tenant's
    roots (the checkpoint read and the output written are inside them: both were checked when
    the export was asked for). An output an admin chose outside them runs unconfined."""
    env = credentials_env(settings, tenant)
    if job_roots(settings, session, job_id, tenant) is not None:
        roots = tenant_roots(settings, session, tenant)
        if roots.allows(output, "write"):
            env[ENV_STORAGE_ROOTS] = roots.to_env()
    return env


def eval_env(settings: Settings, session: Session, job_id: str, tenant: str) -> dict[str, str]:
    """An evaluation's environment: the tenant's credentials and, for a confined job, the
    tenant's roots (the checkpoint it reads is inside them; it writes nothing)."""
    env = credentials_env(settings, tenant)
    if job_roots(settings, session, job_id, tenant) is not None:
        env[ENV_STORAGE_ROOTS] = tenant_roots(settings, session, tenant).to_env()
    return env


def output_problem(output: str, roots: StorageRoots | None) -> str | None:
    """Why an export may not write `output` (None: it may)."""
    if roots is None or roots.allows(output, "write"):
        return None
    return outside_message("output", output, roots, "write")


def check_root(root: str) -> str:
    """A root an admin grants: an absolute local path or s3://bucket[/prefix], normalised."""
    if not isinstance(root, str) or not (root.startswith("/") or root.startswith("s3://")):
        raise ValueError(f"storage root {root!r}: give an absolute local path or s3://bucket[/prefix]")
    if normalize(root) is None:
        raise ValueError(f"storage root {root!r} is not a plain location (no '.', '..' or empty segments)")
    if root.startswith("/") and os.path.normpath(root) == "/":
        raise ValueError("storage root '/' would grant everything: name a folder")
    return root.rstrip("/") if root != "/" else root


def set_grants(session: Session, tenant: str, roots: list[str], read_roots: list[str]) -> TenantStorage:
    row = session.get(TenantStorage, tenant)
    roots, read_roots = [check_root(r) for r in roots], [check_root(r) for r in read_roots]
    if row is None:
        row = TenantStorage(tenant=tenant, roots=roots, read_roots=read_roots, updated_at=time.time())
        session.add(row)
    else:
        row.roots, row.read_roots, row.updated_at = roots, read_roots, time.time()
    return row
