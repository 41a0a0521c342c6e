"""Recording a new job: the one path every job takes into the store, whether a user submitted it
(POST /v1/jobs) or a sweep made it as a trial (service/reconcile/sweeps.py), so a trial meets the
same quotas, priority ceiling, fit and storage rules as a submission.

Inside the caller's transaction: the admission checks (service/scheduling/admission.py: 403, 422,
429 as HTTPExceptions), the spec as run (service/submission.py), the job row, the storage roots it
may use, its scheduling columns.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from engine.jobspec import JobSpec
from engine.jobspec.storage_roots import StorageRoots
from service.scheduling.admission import check_submission, schedule_fields
from service.scheduling.model import Node
from service.settings import Settings
from service.storage_policy import record_job_roots
from service.store.jobs import create_job
from service.store.models import Job
from service.store.tokens import Principal
from service.submission import effective_spec


def record_new_job(
    session: Session,
    *,
    job_id: str,
    caller: Principal,
    spec: JobSpec,
    roots: StorageRoots | None,
    settings: Settings,
    capacity: list[Node] | None,
    idempotency_key: str | None = None,
    request_hash: str | None = None,
) -> Job:
    """The queued job row for `spec`, accepted already (service/submission.accept_spec)."""
    demand = check_submission(session, caller, spec, capacity, settings)
    run_spec = effective_spec(spec, job_id=job_id, caller=caller, settings=settings, session=session)
    job = create_job(
        session,
        job_id=job_id,
        tenant=caller.tenant,
        spec=run_spec,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
    )
    record_job_roots(session, job_id, caller.tenant, roots)
    schedule_fields(job, spec, demand, run_spec["checkpoint"]["path"])
    return job
