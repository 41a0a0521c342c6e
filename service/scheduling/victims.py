"""Which running jobs give way to a job that does not fit: shrunk, or stopped at a checkpoint and
requeued, the fewest and cheapest first.

The rule, and why: only for a job whose priority level (whole levels of the aged priority,
service/scheduling/ordering.py) is strictly higher than the running job's (whose age stops
counting while it runs), and for a reserving job over the jobs backfilled past it. A running job
keeps the credit its wait earned, so a job that waited its way to the front is not thrown out by
the next urgent arrival of the level it overtook; two jobs can take turns only as slowly as aging
lets a preempted one overtake again (a time slice of aging_s per priority level between them,
never a quick ping-pong). Victims are the fewest and cheapest: first elastic jobs above their
minimum, shrunk (they continue on fewer ranks from a resharded checkpoint), then whole jobs
stopped at a checkpoint and requeued, the lowest priority and the smallest first.
`preemptible: false` jobs are never touched.

Its own module: the choice of victims for one waiting job, returned as resizes and preemptions.
It admits nothing, and records or stops nothing (the reconciler carries out what it chose:
service/reconcile/preemption.py and service/reconcile/resize.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from service.scheduling.model import Job, Policy, Preemption, Resize, Running
from service.scheduling.ordering import effective_priority
from service.scheduling.placement import Cluster, fit_on, give_back, need_text, shrunk_placement


class Room(NamedTuple):
    """What making room for one job came to."""

    reason: str  # the job's waiting reason
    coming: bool  # room is being made for it (its victims are stopping or shrinking)
    resize: list[Resize]
    preempt: list[Preemption]


def make_room(
    cluster: Cluster,
    running: Sequence[Running],
    stopping: set[str],
    job: Job,
    now: float,
    policy: Policy,
) -> Room:
    """Preempt (shrink, then stop) what `job` may take, fewest and cheapest first, when that frees
    enough for it; return its waiting reason, whether room is being made for it, and the victims."""
    need = need_text(job, cluster)
    if not policy.preemption:
        return Room(need, False, [], [])
    pending = [r for r in running if r.job.id in stopping]
    if pending:
        return Room(need + f"; waiting for {len(pending)} job(s) to stop or shrink", True, [], [])
    candidates = [
        r
        for r in running
        if r.job.preemptible
        and r.job.id not in stopping
        and (effective_priority(r.job, None, policy) < effective_priority(job, now, policy) or r.backfilled_for == job.id)
    ]
    if not candidates:
        return Room(need, False, [], [])

    def free_after(victims: Mapping[str, int]) -> dict[str, list[float]]:
        """Free room once each victim is at its new size (0: stopped)."""
        free = {n: list(v) for n, v in cluster.free.items()}
        for r in candidates:
            if r.job.id in victims:
                give_back(free, r.job.shape, shrunk_placement(r.placement, r.ranks - victims[r.job.id], gone=True))
        return free

    def fits(victims: Mapping[str, int]) -> bool:
        return cluster.ranks_that_fit(job.shape, free_after(victims)) >= job.lo

    victims: dict[str, int] = {}  # job id -> its size after (0: stopped)
    free = {n: list(v) for n, v in cluster.free.items()}  # kept as victims are added
    fit = {n: fit_on(job.shape, cpu, gpu) for n, (cpu, gpu) in free.items()}  # ranks of `job` per node
    total = [sum(fit.values())]

    def resize(r: Running, size: int) -> None:
        old = victims.get(r.job.id, r.ranks)
        now_on = shrunk_placement(r.placement, r.ranks - old)
        gone = shrunk_placement(now_on, old - size, gone=True)
        give_back(free, r.job.shape, gone)
        for n in gone:
            if n in free:
                new = fit_on(job.shape, *free[n])
                total[0] += new - fit[n]
                fit[n] = new
        victims[r.job.id] = size

    def room() -> bool:
        return total[0] >= job.lo

    # Shrink elastic jobs above their minimum first: the lowest priority, the most room first.
    for r in sorted(candidates, key=lambda r: (r.job.priority, -(r.ranks - r.job.lo), r.job.id)):
        if not policy.shrink:
            break
        while not room() and r.job.size_at_most(victims.get(r.job.id, r.ranks) - 1):
            resize(r, r.job.size_at_most(victims.get(r.job.id, r.ranks) - 1))
    # Then stop whole jobs: backfilled ones first, then the lowest priority, the smallest first.
    for r in sorted(candidates, key=lambda r: (r.backfilled_for != job.id, r.job.priority, r.ranks, r.job.id)):
        if room():
            break
        resize(r, 0)
    if not room():
        return Room(need + "; preempting every lower-priority job would not free enough", False, [], [])
    # The fewest and cheapest: give back, last chosen first, whatever the job fits without; an
    # elastic job stopped whole keeps the largest size the job still fits beside.
    by_id = {r.job.id: r for r in candidates}
    for job_id in reversed(list(victims)):
        trial = {k: v for k, v in victims.items() if k != job_id}
        if fits(trial):
            victims = trial
            continue
        if victims[job_id] == 0 and policy.shrink:
            r = by_id[job_id]
            size = r.job.size_at_most(r.ranks - 1)
            while size and not fits({**victims, job_id: size}):
                size = r.job.size_at_most(size - 1)
            victims[job_id] = size
    resizes: list[Resize] = []
    preemptions: list[Preemption] = []
    for job_id, size in victims.items():
        r = by_id[job_id]
        if size:
            placement = shrunk_placement(r.placement, r.ranks - size)
            resizes.append(Resize(job_id, size, placement, f"shrunk for {job.id} (priority {job.priority})"))
        else:
            reclaimed = r.backfilled_for == job.id
            why = (
                "backfilled ahead of it"
                if reclaimed
                else f"priority {effective_priority(job, now, policy)} > {effective_priority(r.job, None, policy)}"
            )
            preemptions.append(Preemption(job_id, f"preempted for {job.id} ({why})", job.id, reclaimed))
    return Room(need + f"; making room: {len(victims)} job(s) preempted or shrunk", True, resizes, preemptions)
