"""The scheduler's inputs read from the store: the running jobs with their placements, the queue,
the tenants' quotas, and which running jobs are already being stopped.

One query for the non-final jobs (no specs loaded: each row carries its demand, computed at
submission), one for the quotas. What is read here is everything the scheduler decides on, so an API
restarted over the same store rebuilds the same queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.scheduling.demand import Demand, core_job, place_anywhere, stored_demand
from service.scheduling.model import Job as CoreJob
from service.scheduling.model import Node, Quota, Running
from service.states import FINAL, JobState
from service.store.models import Job, TenantQuota

_NON_FINAL = [str(s) for s in JobState if s not in FINAL]


@dataclass
class SchedulerInputs:
    running: list[Running] = field(default_factory=list)
    queued: list[CoreJob] = field(default_factory=list)
    quotas: dict[str, Quota] = field(default_factory=dict)
    stopping: set[str] = field(default_factory=set)
    demands: dict[str, Demand] = field(default_factory=dict)
    # What the store says now, so only changes are written back.
    shown: dict[str, tuple[int | None, str | None]] = field(default_factory=dict)
    priorities: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (tenant, priority)
    queued_since: dict[str, float] = field(default_factory=dict)
    # Resized jobs that stopped and wait to be launched again at once: id -> (ranks, placement).
    # Their room is held (they count as running) and nothing else may take it.
    relaunch: dict[str, tuple[int, dict[str, int]]] = field(default_factory=dict)
    placements: dict[str, dict[str, int]] = field(default_factory=dict)  # running jobs' rooms
    launched_at: dict[str, float] = field(default_factory=dict)  # running jobs' last launch


def quota_of(row: TenantQuota) -> Quota:
    return Quota(ranks=row.ranks, gpus=row.gpus, cpus=row.cpus, queued=row.queued)


def read_quotas(session: Session) -> dict[str, Quota]:
    return {row.tenant: quota_of(row) for row in session.scalars(select(TenantQuota))}


def _hold(free: dict[str, list[float]], job: CoreJob, placement: dict[str, int]) -> None:
    for node, k in placement.items():
        if node in free:
            free[node][0] -= k * job.shape.cpus
            free[node][1] -= k * job.shape.gpus


def read_inputs(session: Session, nodes: list[Node], demands: dict[str, Demand] | None = None) -> SchedulerInputs:
    """`demands`: the caller's cache of the jobs' demands (a job's never changes); filled here
    and pruned to the non-final jobs, so a pass reads only new jobs' demands."""
    cluster_gpus = sum(n.gpus for n in nodes if n.alive)
    cache = {} if demands is None else demands
    rows = session.execute(
        select(
            Job.id,
            Job.tenant,
            Job.state,
            Job.submission_id,
            Job.cancel_requested_at,
            Job.preempt_requested_at,
            Job.priority,
            Job.preemptible,
            Job.created_at,
            Job.queued_at,
            Job.waited_s,
            Job.yields_to,
            Job.placement,
            Job.backfilled_for,
            Job.queue_position,
            Job.waiting_reason,
            Job.resize_to,
            Job.resize_placement,
            Job.launched_at,
        )
        .where(Job.state.in_(_NON_FINAL))
        .order_by(Job.seq)
    ).all()
    new = [r.id for r in rows if r.id not in cache]
    for i in range(0, len(new), 500):
        chunk = new[i : i + 500]
        stored = dict(session.execute(select(Job.id, Job.demand).where(Job.id.in_(chunk))).all())
        bare = [job_id for job_id in chunk if not stored.get(job_id)]
        specs = dict(session.execute(select(Job.id, Job.spec).where(Job.id.in_(bare))).all()) if bare else {}
        for job_id in chunk:
            cache[job_id] = stored_demand(stored.get(job_id), specs.get(job_id, {}))
    live = {r.id for r in rows}
    for job_id in [j for j in cache if j not in live]:
        del cache[job_id]
    out = SchedulerInputs(quotas=read_quotas(session))
    unplaced: list[tuple[CoreJob, str | None]] = []
    free: dict[str, list[float]] = {n.id: [n.cpus, n.gpus] for n in nodes if n.alive}
    for r in rows:
        demand = cache[r.id]
        out.demands[r.id] = demand
        out.priorities[r.id] = (r.tenant, r.priority or 0)
        job = core_job(
            job_id=r.id,
            tenant=r.tenant,
            demand=demand,
            cluster_gpus=cluster_gpus,
            priority=r.priority or 0,
            preemptible=bool(r.preemptible),
            submitted_at=r.created_at,
            waited_s=r.waited_s or 0.0,
            waiting_since=r.queued_at if r.queued_at is not None else r.created_at,
            yields_to=r.yields_to,
        )
        if r.submission_id is None and r.resize_to and r.state == JobState.QUEUED and r.cancel_requested_at is None:
            placement = {str(k): int(v) for k, v in (r.resize_placement or {}).items()}
            out.relaunch[r.id] = (r.resize_to, placement)
            out.stopping.add(r.id)
            out.running.append(Running(job, placement))
            _hold(free, job, placement)
            continue
        if r.submission_id is None:
            if r.state == JobState.QUEUED and r.cancel_requested_at is None:
                out.queued.append(job)
                out.shown[r.id] = (r.queue_position, r.waiting_reason)
                out.queued_since[r.id] = job.waiting_since
            continue
        if r.cancel_requested_at is not None or r.preempt_requested_at is not None:
            out.stopping.add(r.id)
        if r.placement:
            placement = {str(k): int(v) for k, v in r.placement.items()}
            out.placements[r.id] = dict(placement)
            if r.resize_to and r.resize_placement:  # resizing: it holds the larger of both rooms
                for node, k in r.resize_placement.items():
                    placement[str(node)] = max(placement.get(str(node), 0), int(k))
            out.running.append(Running(job, placement, r.backfilled_for))
            _hold(free, job, placement)
            if r.launched_at is not None:
                out.launched_at[r.id] = r.launched_at
        else:
            unplaced.append((job, r.backfilled_for))
    # Launched before the scheduler counted them (capacity was unknown, or an older version):
    # counted where they fit, at their starting size.
    for job, backfilled_for in unplaced:
        placement = place_anywhere(nodes, free, job.shape, job.ranks)
        out.running.append(Running(job, placement, backfilled_for))
    return out
