"""Who runs next on a shared cluster: one pure decision from the cluster's state, the running jobs,
the queue and the tenants' quotas to admissions, preemptions, resizes and a reason per waiting job.

No clock, no database, no Ray: the reconciler gathers the state, calls `decide`, and applies what
comes back (service/reconcile/scheduling_pass.py); the property tests and bench/scheduler.py
drive the same function on a simulated clock (service/scheduling/simulate.py).

`decide` walks the queue in order (service/scheduling/ordering.py: aged priority, fair share,
submission time), skips the jobs over their tenant's quota (service/scheduling/quotas.py), admits
each whole job that fits node by node (service/scheduling/placement.py: gang admission), and holds
the rest to the rule that is this module's own:
- **Reservation and backfill.** The first job in order that does not fit holds a reservation: no
  job behind it starts, except a *backfilled* one: a preemptible job that starts in what is free
  now and that the reserving job may take back (preempt) whenever it needs the room, whatever
  their priorities. So backfill can never delay the reserving job by more than
  one checkpoint-and-stop, and uses the cluster while it waits. (Slurm's backfill needs run-time
  limits to promise the same; training jobs rarely know theirs.) For the reserving job, room is
  made by preempting or shrinking lower-priority jobs when that frees enough
  (service/scheduling/victims.py); when no job waits for room, elastic jobs grow into it
  (service/scheduling/growth.py).
- **No job waits forever.** Aging raises a waiting job's effective priority without bound, so
  it reaches the head of the queue; the head holds a reservation no later job may take except
  by backfill the head can reclaim; so the head starts once the jobs it cannot preempt finish,
  and every job finishes (tests/service/test_scheduling_core.py checks it on random traces).

It must not take over a rule those modules hold (the order, where ranks fit, which jobs give way),
nor reach the store, Ray or a clock of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from service.scheduling.growth import grow
from service.scheduling.model import Admission, Job, Node, Policy, Preemption, Quota, Resize, Running
from service.scheduling.ordering import queue_order
from service.scheduling.placement import Cluster, largest_fit, need_text
from service.scheduling.quotas import Usage, quota_excess, quota_room
from service.scheduling.victims import make_room


class Waiting(NamedTuple):
    position: int  # 1 = next in order
    reason: str


@dataclass
class Decision:
    admit: list[Admission] = field(default_factory=list)
    preempt: list[Preemption] = field(default_factory=list)
    resize: list[Resize] = field(default_factory=list)
    waiting: dict[str, Waiting] = field(default_factory=dict)


def decide(
    nodes: Sequence[Node],
    running: Sequence[Running],
    queued: Sequence[Job],
    quotas: Mapping[str, Quota],
    now: float,
    policy: Policy = Policy(),
    stopping: Iterable[str] = (),
) -> Decision:
    """One scheduling pass. `stopping`: running jobs already told to stop or shrink (their room is
    not free yet, and they are not chosen again)."""
    stopping = set(stopping)
    cluster = Cluster(nodes, running)
    totals = cluster.total()
    usage: dict[str, Usage] = {}
    for r in running:
        usage.setdefault(r.job.tenant, Usage()).add(r.job.shape, r.ranks)
    decision = Decision()
    order = queue_order(queued, usage, totals, now, policy)
    head: Job | None = None  # the first job that does not fit: it holds a reservation
    backfill = policy.backfill
    ahead_by_priority: dict[int, int] = {}
    position = 0
    for job in order:
        tenant = usage.setdefault(job.tenant, Usage())
        quota = quotas.get(job.tenant)
        allowed = 1 << 30
        if quota is not None:
            excess = quota_excess(quota, tenant, job.shape, job.lo)
            if excess is not None:
                position += 1
                decision.waiting[job.id] = Waiting(position, f"tenant {job.tenant} {excess}")
                continue
            allowed = quota_room(quota, tenant, job.shape)
        if head is None:
            size = largest_fit(cluster, job, allowed)
            if size:
                placement = cluster.place(job.shape, size)
                cluster.take(job.shape, placement)
                tenant.add(job.shape, size)
                decision.admit.append(Admission(job.id, size, placement))
                continue
            head = job
            position += 1
            room = make_room(cluster, running, stopping, job, now, policy)
            decision.resize += room.resize
            decision.preempt += room.preempt
            # The free room now is part of what the head will start on once its victims stop:
            # nothing backfills into it meanwhile.
            backfill = policy.backfill and not room.coming
            decision.waiting[job.id] = Waiting(position, room.reason)
            ahead_by_priority[job.priority] = ahead_by_priority.get(job.priority, 0) + 1
            continue
        # Behind a reservation only backfill starts: a preemptible job the head may take back.
        if (backfill and job.preemptible) or not policy.reserve:
            size = largest_fit(cluster, job, allowed)
            if size:
                placement = cluster.place(job.shape, size)
                cluster.take(job.shape, placement)
                tenant.add(job.shape, size)
                backfilled_for = head.id if policy.reserve else None
                decision.admit.append(Admission(job.id, size, placement, backfilled_for=backfilled_for))
                continue
        position += 1
        higher = sum(c for p, c in ahead_by_priority.items() if p >= job.priority)
        decision.waiting[job.id] = Waiting(
            position, need_text(job, cluster) + f"; behind {higher} job(s) of priority >= {job.priority}"
        )
        ahead_by_priority[job.priority] = ahead_by_priority.get(job.priority, 0) + 1
    if policy.grow and head is None:
        decision.resize += grow(cluster, running, stopping, usage, quotas, {a.job_id for a in decision.admit})
    return decision
