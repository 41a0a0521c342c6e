"""A tenant's quota against what it uses: whether a job would take it past its limits, and how
many more ranks its limits leave.

The rule, and why: a tenant's running ranks, CPUs and GPUs have limits; a job over its tenant's
quota waits with that reason and reserves nothing (it must not block others), and an elastic job
grows only as far as its tenant's quota allows. (The limit on queued jobs is checked at submission,
service/scheduling/admission.py.)

Its own module because the decision pass, elastic growth and the never-fits check at submission
all ask it. It only measures: it orders no job and places none.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.scheduling.model import Quota, Shape


@dataclass
class Usage:
    """What one tenant holds (running, or admitted in this pass)."""

    ranks: int = 0
    cpus: float = 0.0
    gpus: float = 0.0

    def add(self, shape: Shape, ranks: int, sign: int = 1) -> None:
        self.ranks += sign * ranks
        self.cpus += sign * ranks * shape.cpus
        self.gpus += sign * ranks * shape.gpus


def quota_excess(quota: Quota | None, usage: Usage, shape: Shape, ranks: int) -> str | None:
    """Why `ranks` more ranks of `shape` would take a tenant past its quota, or None."""
    if quota is None:
        return None
    checks = (
        ("ranks", quota.ranks, usage.ranks, ranks),
        ("GPUs", quota.gpus, usage.gpus, ranks * shape.gpus),
        ("CPUs", quota.cpus, usage.cpus, ranks * shape.cpus),
    )
    for what, limit, used, more in checks:
        if limit is not None and used + more > limit:
            return f"at its quota: {used:g}/{limit:g} {what} in use, the job needs {more:g}"
    return None


def quota_room(quota: Quota | None, usage: Usage, shape: Shape) -> int:
    """How many more ranks of `shape` a tenant's quota allows (a large number: unlimited)."""
    room = 1 << 30
    if quota is None:
        return room
    if quota.ranks is not None:
        room = min(room, quota.ranks - usage.ranks)
    for limit, used, per_rank in ((quota.gpus, usage.gpus, shape.gpus), (quota.cpus, usage.cpus, shape.cpus)):
        if limit is not None and per_rank > 0:
            room = min(room, int((limit - used + 1e-9) // per_rank))
    return max(room, 0)
