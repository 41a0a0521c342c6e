"""What the scheduler checks when a job is submitted, before it is recorded:

- `scheduling.preemptible: false` is for admins, and for tenants an admin allowed it
  (`allow_non_preemptible` in the tenant's quota): a job nothing may preempt can hold its GPUs
  against every more urgent job, which is the cluster operator's call, not each tenant's;
- `scheduling.priority` at most the tenant's `max_priority` when its quota sets one, else at most
  ELASTRON_MAX_PRIORITY (admins: any): otherwise any tenant could declare its jobs the most urgent
  and preempt everyone (issue 61). Above it: 422 naming the field;
- a job that could never run, on the whole cluster as the reconciler last read it or within its
  tenant's quota, is a 422 naming the numbers (placement.never_fits). Capacity not known yet: accepted;
- at most `queued` jobs of the tenant waiting (429 naming the limit).

And what is kept on the job row for the scheduler: priority, whether it may be preempted, its
demand, when its wait began.
"""

from __future__ import annotations

from fastapi import HTTPException, status
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from engine.jobspec import JobSpec
from service.scheduling.demand import Demand, core_job, demand_of, may_preempt
from service.scheduling.model import Node
from service.scheduling.placement import never_fits
from service.scheduling.state import quota_of
from service.settings import Settings
from service.states import JobState
from service.store.models import Job, TenantQuota
from service.store.tokens import Principal


def _check_priority(caller: Principal, priority: int, quota: TenantQuota | None, ceiling: int) -> None:
    if caller.admin:
        return
    if quota is not None and quota.max_priority is not None:
        ceiling, source = quota.max_priority, f"tenant {caller.tenant}'s quota"
    else:
        source = "ELASTRON_MAX_PRIORITY (no quota of tenant " + caller.tenant + " sets max_priority)"
    if priority > ceiling:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail=[
                {
                    "loc": ["body", "scheduling", "priority"],
                    "msg": f"scheduling.priority: {priority} is above the most {source} allows ({ceiling}): "
                    f"use {ceiling} or less, or ask an admin for a quota (elastron tenants set-quota "
                    f"{caller.tenant} --max-priority N)",
                    "type": "value_error",
                }
            ],
        )


def check_submission(
    session: Session, caller: Principal, spec: JobSpec, capacity: list[Node] | None, settings: Settings
) -> Demand:
    """Raise the 403/422/429 the submission earns; return the job's demand."""
    quota = session.get(TenantQuota, caller.tenant)
    sched = spec.scheduling
    if not sched.preemptible and not caller.admin and not (quota is not None and quota.allow_non_preemptible):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            detail="scheduling.preemptible: false is reserved to admins and to tenants an admin allows "
            f"(elastron tenants set-quota {caller.tenant} --allow-non-preemptible): remove it, the job is then "
            "stopped at a checkpoint and resumed when a more urgent job needs its room",
        )
    _check_priority(caller, sched.priority, quota, settings.max_priority)
    demand = demand_of(spec)
    if capacity:
        job = core_job(
            job_id="new",
            tenant=caller.tenant,
            demand=demand,
            cluster_gpus=sum(n.gpus for n in capacity if n.alive),
        )
        why = never_fits(job, capacity, quota_of(quota) if quota is not None else None)
        if why is not None:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                detail=[
                    {
                        "loc": ["body", "resources", "ranks"],
                        "msg": f"resources.ranks: this job could never run: {why}",
                        "type": "value_error",
                    }
                ],
            )
    if quota is not None and quota.queued is not None:
        waiting = session.scalar(
            select(func.count())
            .select_from(Job)
            .where(
                Job.tenant == caller.tenant,
                Job.state == JobState.QUEUED.value,
                Job.submission_id.is_(None),
                Job.cancel_requested_at.is_(None),
            )
        )
        if waiting >= quota.queued:
            raise HTTPException(
                status.HTTP_429_TOO_MANY_REQUESTS,
                detail=f"tenant {caller.tenant} has {waiting} jobs queued, its quota's limit is {quota.queued}: "
                "submit again when some have started, or cancel one",
                headers={"Retry-After": "60"},
            )
    return demand


def schedule_fields(job: Job, spec: JobSpec, demand: Demand, checkpoint_path: str | None) -> None:
    """Fill the new job row's scheduling columns."""
    job.priority = spec.scheduling.priority
    job.preemptible = may_preempt(spec, checkpoint_path)
    job.demand = demand.to_json()
    job.queued_at = job.created_at
    job.waited_s = 0.0
