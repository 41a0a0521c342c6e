"""The scheduler's vocabulary: what a decision is made from (the cluster's nodes, the jobs as the
scheduler sees them, the running ones with their placements, the tenants' quotas, the policy) and
the actions it returns (admissions, resizes, preemptions).

Its own module so that ordering, placement, victim selection and the decision pass
(service/scheduling/decision.py) speak the same types without importing each other. Plain frozen
values only: no rule of the scheduler lives here (a job's sizes, `Job.size_at_most`, are a fact of
the job), nor anything of the store or Ray (service/scheduling/demand.py turns a stored job into a
`Job`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple


class Shape(NamedTuple):
    """What one rank of a job takes on one node (a tuple: it keys the per-shape caches)."""

    cpus: float = 1.0
    gpus: float = 0.0


@dataclass(frozen=True)
class Node:
    id: str
    cpus: float
    gpus: float
    alive: bool = True


@dataclass(frozen=True)
class Quota:
    """A tenant's limits; None: unlimited."""

    ranks: int | None = None
    gpus: float | None = None
    cpus: float | None = None
    queued: int | None = None


@dataclass(frozen=True)
class Job:
    """A job as the scheduler sees it. `ranks` is where it starts (and its size when not elastic);
    an elastic job runs on any size in [min_ranks, max_ranks] (both default to `ranks`)."""

    id: str
    tenant: str
    shape: Shape
    ranks: int
    priority: int = 0
    submitted_at: float = 0.0  # first submission: the tie-break at equal priority and share
    waited_s: float = 0.0  # time spent queued before the current wait (a preempted job keeps it)
    waiting_since: float | None = None  # when the current wait began (default: submitted_at)
    # Preempted to make room for this job (backfill taken back): it queues right behind it, so
    # the room it gave up goes to the job it was taken back for.
    yields_to: str | None = None
    min_ranks: int | None = None
    max_ranks: int | None = None
    preemptible: bool = True
    size_step: int = 1  # an elastic job's sizes are multiples of this (tensor x pipeline x context)

    @property
    def lo(self) -> int:
        return self.min_ranks if self.min_ranks is not None else self.ranks

    @property
    def hi(self) -> int:
        return self.max_ranks if self.max_ranks is not None else self.ranks

    def size_at_most(self, n: int) -> int:
        """The largest size this job runs on that is <= n (0: none, below its minimum)."""
        n = min(n, self.hi)
        if n < self.lo:
            return 0
        if n == self.ranks:
            return n
        n -= n % self.size_step
        return n if n >= self.lo else 0


@dataclass(frozen=True)
class Running:
    """A job that holds resources: `placement` is ranks per node. `backfilled_for` names the job
    it started ahead of by backfill (that job may take its room back)."""

    job: Job
    placement: Mapping[str, int]
    backfilled_for: str | None = None

    @property
    def ranks(self) -> int:
        return sum(self.placement.values())


@dataclass(frozen=True)
class Admission:
    job_id: str
    ranks: int
    placement: dict[str, int]
    backfilled_for: str | None = None


@dataclass(frozen=True)
class Resize:
    job_id: str
    ranks: int  # the new size
    placement: dict[str, int]  # the new placement
    reason: str


@dataclass(frozen=True)
class Preemption:
    job_id: str
    reason: str
    for_job: str  # the job it makes room for
    reclaimed: bool  # backfill taken back: requeue it with yields_to=for_job


@dataclass(frozen=True)
class Policy:
    aging_s: float = 3600.0  # one priority level per hour waited
    order: str = "priority"  # or "fifo": submission time only (a baseline for bench/scheduler.py)
    # False: no reservation, any job that fits starts (greedy first fit, as Ray places placement
    # groups when it is handed every job at once: today's behaviour, a baseline; big jobs starve).
    reserve: bool = True
    backfill: bool = True
    preemption: bool = True
    grow: bool = True  # elastic jobs take free room up to max_ranks when nothing waits for it
    shrink: bool = True  # False: preemption stops whole jobs only, never shrinks an elastic one
