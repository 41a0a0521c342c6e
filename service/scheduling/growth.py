"""Elastic jobs growing into free room: when nothing waits for it, a running elastic job below its
`max_ranks` takes what is free, within its tenant's quota, the highest priority first.

Only preemptible jobs grow: a resize is a save of the current step, a stop and a restart from that
checkpoint, which a job that cannot resume would lose. (The reconciler holds a grow back until the
job has run a while at its size: service/reconcile/resize.py.)

Its own module: the one rule that hands room to running jobs rather than queued ones. It must only
be asked when no job waits for room (the decision pass, service/scheduling/decision.py, asks it
only then), and it shrinks and stops nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from service.scheduling.model import Quota, Resize, Running
from service.scheduling.placement import Cluster
from service.scheduling.quotas import Usage, quota_room


def grow(
    cluster: Cluster,
    running: Sequence[Running],
    stopping: set[str],
    usage: dict[str, Usage],
    quotas: Mapping[str, Quota],
    admitted: set[str],
) -> list[Resize]:
    """The resizes that grow elastic jobs below their maximum into what is free (taken from
    `cluster` and added to `usage` as they are chosen); `admitted`: the jobs admitted this pass."""
    resizes: list[Resize] = []
    for r in sorted(running, key=lambda r: (-r.job.priority, r.job.submitted_at)):
        if r.job.id in stopping or r.job.id in admitted or r.ranks >= r.job.hi or not r.job.preemptible:
            continue
        tenant = usage.setdefault(r.job.tenant, Usage())
        room = min(cluster.ranks_that_fit(r.job.shape), quota_room(quotas.get(r.job.tenant), tenant, r.job.shape))
        size = r.job.size_at_most(r.ranks + room)
        more = size - r.ranks
        if more <= 0:
            continue
        extra = cluster.place(r.job.shape, more)
        if extra is None:
            continue
        cluster.take(r.job.shape, extra)
        tenant.add(r.job.shape, more)
        placement = dict(r.placement)
        for n, k in extra.items():
            placement[n] = placement.get(n, 0) + k
        resizes.append(Resize(r.job.id, r.ranks + more, placement, "grown into free room"))
    return resizes
