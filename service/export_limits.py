"""How many exports one tenant may have in flight, and one export per identical request.

An export reads a whole checkpoint and writes a whole model (minutes of a worker, gigabytes of
storage): unbounded, one tenant's loop of requests fills the cluster and the bucket (the issue 61
audit had 200 accepted for one checkpoint). So, counted over the exports not yet finished
(pending or running): at most ELASTRON_MAX_EXPORTS_PER_CHECKPOINT of one checkpoint and
ELASTRON_MAX_EXPORTS_PER_TENANT of one tenant's jobs; more is a 429 naming the limit. A request
identical to an export that is in flight or succeeded (same job, iteration, format, dtype and
output) is answered with that export instead of a second one: a client's retry costs nothing.
A failed export may be asked for again.
"""

from __future__ import annotations

from fastapi import HTTPException, status
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.settings import Settings
from service.store.exports import SUCCEEDED, UNFINISHED
from service.store.models import Export, Job, RequestLimit

RETRY_AFTER_S = 30


def identical_export(
    session: Session, job_id: str, iteration: int, format: str, dtype: str, output: str
) -> Export | None:
    """The newest export of the same request that is in flight or succeeded, if any."""
    return session.scalar(
        select(Export)
        .where(
            Export.job_id == job_id,
            Export.iteration == iteration,
            Export.format == format,
            Export.dtype == dtype,
            Export.output == output,
            Export.status.in_((*UNFINISHED, SUCCEEDED)),
        )
        .order_by(Export.created_at.desc())
        .limit(1)
    )


def check_export_limits(session: Session, job: Job, iteration: int, settings: Settings) -> None:
    """Raise the 429 a new export of `job`'s checkpoint `iteration` earns, if any. Call it in the
    transaction that records the export: concurrent requests of one tenant then count one after
    the other (Postgres: the tenant's export rate row, locked; SQLite: one writer at a time, and a
    count read before another writer's commit fails the transaction, which in_transaction redoes)."""
    session.execute(
        select(RequestLimit.tenant)
        .where(RequestLimit.tenant == job.tenant, RequestLimit.kind == "export")
        .with_for_update()
    )
    in_flight = Export.status.in_(UNFINISHED)
    of_checkpoint = session.scalar(
        select(func.count())
        .select_from(Export)
        .where(Export.job_id == job.id, Export.iteration == iteration, in_flight)
    )
    if of_checkpoint >= settings.max_exports_per_checkpoint:
        raise _too_many(
            f"checkpoint {iteration} of job {job.id} already has {of_checkpoint} exports pending or running, "
            f"the most ELASTRON_MAX_EXPORTS_PER_CHECKPOINT allows ({settings.max_exports_per_checkpoint})"
        )
    of_tenant = session.scalar(
        select(func.count())
        .select_from(Export)
        .join(Job, Job.id == Export.job_id)
        .where(Job.tenant == job.tenant, in_flight)
    )
    if of_tenant >= settings.max_exports_per_tenant:
        raise _too_many(
            f"tenant {job.tenant} already has {of_tenant} exports pending or running, the most "
            f"ELASTRON_MAX_EXPORTS_PER_TENANT allows ({settings.max_exports_per_tenant})"
        )


def _too_many(why: str) -> HTTPException:
    return HTTPException(
        status.HTTP_429_TOO_MANY_REQUESTS,
        detail=f"{why}: wait for one to finish (GET /v1/jobs/{{job_id}}/exports) and ask again",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )
