"""Who goes first among the queued jobs: aged priority, then fair share between tenants, then
submission time.

The rule, and why: effective priority (the job's `priority`, plus one level per `aging_s` spent
waiting in the queue, this wait and earlier ones: `aged_priority`), then fair share between
tenants, then submission time. Fair share is dominant-resource fairness (Ghodsi et al., NSDI
2011): at equal priority the tenant whose largest share of any one resource (CPUs or GPUs) is
smallest goes first. DRF is the rule for a cluster of two resource kinds where one tenant runs GPU
jobs and another CPU-only ones: counting GPUs alone would let a CPU tenant take every core for
free, counting ranks would weigh a 1-CPU rank like an 8-GPU one. Aging raises a waiting job's
effective priority without bound, so every job reaches the head of the queue. A job taken back
for another (backfill reclaimed) queues right behind the job it yielded to.

Its own module: the order is a pure function of the queue, the tenants' use and the clock. It
places nothing and chooses no victim (service/scheduling/victims.py asks `effective_priority`
who may preempt whom).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

from service.scheduling.model import Job, Policy
from service.scheduling.quotas import Usage


def aged_priority(job: Job, now: float | None, policy: Policy) -> float:
    """`priority` plus one per `aging_s` queued; `now` None: a running job (its age is frozen at
    what its waits earned)."""
    waited = job.waited_s
    if now is not None:
        since = job.waiting_since if job.waiting_since is not None else job.submitted_at
        waited += max(0.0, now - since)
    return job.priority + (waited / policy.aging_s if policy.aging_s > 0 else 0.0)


def effective_priority(job: Job, now: float | None, policy: Policy) -> int:
    """The priority level (whole levels of `aged_priority`): the queue's order and who may
    preempt whom."""
    return math.floor(aged_priority(job, now, policy))


def queue_order(
    queued: Sequence[Job], usage: Mapping[str, Usage], totals: tuple[float, float], now: float, policy: Policy
) -> list[Job]:
    """Effective priority, then dominant-resource fairness between tenants (the tenant with the
    smallest dominant share next, its share grown by each job placed in the order as if it ran),
    then submission time."""
    if policy.order == "fifo":
        return sorted(queued, key=lambda j: (j.submitted_at, j.id))
    order = _fair_order(queued, usage, totals, now, policy)
    # A job taken back for another queues right behind it (while that one waits).
    waiting = {j.id for j in order}
    followers: dict[str, list[Job]] = {}
    for j in order:
        if j.yields_to in waiting and j.yields_to != j.id:
            followers.setdefault(j.yields_to, []).append(j)
    if not followers:
        return order
    moved = {j.id for js in followers.values() for j in js}
    out: list[Job] = []

    def emit(j: Job, depth: int = 0) -> None:
        out.append(j)
        if depth < 8:
            for f in followers.get(j.id, ()):
                emit(f, depth + 1)

    for j in order:
        if j.id not in moved:
            emit(j)
    if len(out) < len(order):  # a cycle of yields: keep the fair order for those
        seen = {j.id for j in out}
        out += [j for j in order if j.id not in seen]
    return out


def _fair_order(
    queued: Sequence[Job], usage: Mapping[str, Usage], totals: tuple[float, float], now: float, policy: Policy
) -> list[Job]:
    levels: dict[int, dict[str, list[Job]]] = {}
    for job in queued:
        levels.setdefault(-effective_priority(job, now, policy), {}).setdefault(job.tenant, []).append(job)
    cpus_total, gpus_total = totals
    cpu_w = 1.0 / cpus_total if cpus_total else 0.0
    gpu_w = 1.0 / gpus_total if gpus_total else 0.0
    shares = {t: [u.cpus, u.gpus] for t, u in usage.items()}  # as if each job placed ran
    out: list[Job] = []
    for level in sorted(levels):
        per_tenant = levels[level]
        heap = []
        for tenant, jobs in per_tenant.items():
            jobs.sort(key=lambda j: (j.submitted_at, j.id))
            cpu, gpu = shares.setdefault(tenant, [0.0, 0.0])
            heap.append((max(cpu * cpu_w, gpu * gpu_w), jobs[0].submitted_at, tenant, 0))
        heapq.heapify(heap)
        while heap:
            _, _, tenant, i = heapq.heappop(heap)
            jobs = per_tenant[tenant]
            job = jobs[i]
            out.append(job)
            share = shares[tenant]
            share[0] += job.ranks * job.shape.cpus
            share[1] += job.ranks * job.shape.gpus
            if i + 1 < len(jobs):
                key = max(share[0] * cpu_w, share[1] * gpu_w)
                heapq.heappush(heap, (key, jobs[i + 1].submitted_at, tenant, i + 1))
    return out
