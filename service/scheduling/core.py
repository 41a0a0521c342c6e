"""Who runs next on a shared cluster: one pure decision from the cluster's state, the running jobs,
the queue and the tenants' quotas to admissions, preemptions, resizes and a reason per waiting job.

No clock, no database, no Ray: the reconciler gathers the state, calls `decide`, and applies what
comes back; the property tests and bench/scheduler.py drive the same function on a simulated clock.

The rules, and why:
- **Gang admission.** A job is admitted only when all its ranks fit in what is free by our own
  accounting, node by node (a rank's CPUs and GPUs on one node), so Ray never holds a half-placed
  job. An elastic job is admitted at the largest size between its `min_ranks` and `ranks` that fits.
- **Order.** Effective priority (the job's `priority`, plus one level per `aging_s` spent waiting
  in the queue, this wait and earlier ones: `aged_priority`), then
  fair share between tenants, then submission time. Fair share is dominant-resource fairness
  (Ghodsi et al., NSDI 2011): at equal priority the tenant whose largest share of any one resource
  (CPUs or GPUs) is smallest goes first. DRF is the rule for a cluster of two resource kinds where
  one tenant runs GPU jobs and another CPU-only ones: counting GPUs alone would let a CPU tenant
  take every core for free, counting ranks would weigh a 1-CPU rank like an 8-GPU one.
- **Reservation and backfill.** The first job in order that does not fit holds a reservation: no
  job behind it starts, except a *backfilled* one: a preemptible job that starts in what is free
  now and that the reserving job may take back (preempt) whenever it needs the room, whatever
  their priorities. So backfill can never delay the reserving job by more than
  one checkpoint-and-stop, and uses the cluster while it waits. (Slurm's backfill needs run-time
  limits to promise the same; training jobs rarely know theirs.)
- **Preemption.** Only for a job whose priority level (whole levels of the aged priority) is
  strictly higher than the running job's
  (whose age stops counting while it runs), and for a reserving job over the jobs backfilled past
  it. A running job keeps the credit its wait earned, so a job that waited its way to the front
  is not thrown out by the next urgent arrival of the level it overtook; two jobs can take turns
  only as slowly as aging lets a preempted one overtake again (a time slice of aging_s per
  priority level between them, never a quick ping-pong). Victims are the
  fewest and cheapest: first elastic jobs above their minimum, shrunk (they continue on fewer
  ranks from a resharded checkpoint), then whole jobs stopped at a checkpoint and requeued, the
  lowest priority and the smallest first. `preemptible: false` jobs are never touched.
- **Quotas.** A tenant's running ranks, CPUs and GPUs and its queued jobs have limits; a job over
  its tenant's quota waits with that reason and reserves nothing (it must not block others).
- **No job waits forever.** Aging raises a waiting job's effective priority without bound, so
  it reaches the head of the queue; the head holds a reservation no later job may take except
  by backfill the head can reclaim; so the head starts once the jobs it cannot preempt finish,
  and every job finishes (tests/service/test_scheduling_core.py checks it on random traces).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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


class Waiting(NamedTuple):
    position: int  # 1 = next in order
    reason: str


@dataclass
class Decision:
    admit: list[Admission] = field(default_factory=list)
    preempt: list[Preemption] = field(default_factory=list)
    resize: list[Resize] = field(default_factory=list)
    waiting: dict[str, Waiting] = field(default_factory=dict)


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


def _fit_on(shape: Shape, cpu: float, gpu: float) -> int:
    """Ranks of `shape` that fit in (cpu, gpu) free on one node."""
    n = int(cpu // shape.cpus) if shape.cpus > 0 else 1 << 30
    if shape.gpus > 0:
        n = min(n, int(gpu // shape.gpus))
    return max(n, 0)


def _fmt(x: float) -> str:
    return f"{x:g}"


class _Cluster:
    """Free resources per alive node, with the per-shape count of ranks that fit cached between
    changes (a decision over 10,000 queued jobs asks it for every one of them)."""

    def __init__(self, nodes: Iterable[Node], running: Iterable[Running]):
        self.nodes = {n.id: n for n in nodes if n.alive}
        self.free = {n: [node.cpus, node.gpus] for n, node in self.nodes.items()}
        for r in running:
            self.take(r.job.shape, r.placement)
        self._fits: dict[Shape, int] = {}
        self._texts: dict[tuple[Shape, int], str] = {}

    def demand_text(self, shape: Shape, ranks: int) -> str:
        key = (shape, ranks)
        text = self._texts.get(key)
        if text is None:
            text = self._texts[key] = (
                f"needs {ranks} ranks x ({_fmt(shape.cpus)} CPU, {_fmt(shape.gpus)} GPU), "
                f"{self.ranks_that_fit(shape)} free"
            )
        return text

    def ranks_that_fit(self, shape: Shape, free: Mapping[str, list[float]] | None = None) -> int:
        if free is None:
            if shape not in self._fits:
                self._fits[shape] = self.ranks_that_fit(shape, self.free)
            return self._fits[shape]
        return sum(_fit_on(shape, cpu, gpu) for cpu, gpu in free.values())

    def place(self, shape: Shape, ranks: int, free: Mapping[str, list[float]] | None = None) -> dict[str, int] | None:
        """Ranks per node, fullest nodes first (packing keeps whole nodes free for big jobs)."""
        free = self.free if free is None else free
        out: dict[str, int] = {}
        left = ranks
        order = sorted(free, key=lambda n: (free[n][1], free[n][0], n))
        for n in order:
            k = min(_fit_on(shape, *free[n]), left)
            if k > 0:
                out[n] = k
                left -= k
            if left == 0:
                return out
        return None

    def take(self, shape: Shape, placement: Mapping[str, int], sign: int = 1) -> None:
        for n, k in placement.items():
            if n in self.free:
                self.free[n][0] -= sign * k * shape.cpus
                self.free[n][1] -= sign * k * shape.gpus
        self._fits, self._texts = {}, {}

    def total(self) -> tuple[float, float]:
        return sum(n.cpus for n in self.nodes.values()), sum(n.gpus for n in self.nodes.values())


@dataclass
class _Usage:
    ranks: int = 0
    cpus: float = 0.0
    gpus: float = 0.0

    def add(self, shape: Shape, ranks: int, sign: int = 1) -> None:
        self.ranks += sign * ranks
        self.cpus += sign * ranks * shape.cpus
        self.gpus += sign * ranks * shape.gpus


def quota_excess(quota: Quota | None, usage: _Usage, shape: Shape, ranks: int) -> str | None:
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
            return f"at its quota: {_fmt(used)}/{_fmt(limit)} {what} in use, the job needs {_fmt(more)}"
    return None


def quota_room(quota: Quota | None, usage: _Usage, shape: Shape) -> int:
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


def never_fits(job: Job, nodes: Sequence[Node], quota: Quota | None = None) -> str | None:
    """Why `job` could not run even on an empty cluster within its tenant's quota (the service
    refuses it at submission with a 422 naming these numbers), or None."""
    empty = _Cluster(nodes, ())
    fit = empty.ranks_that_fit(job.shape)
    if fit < job.lo:
        cpus, gpus = empty.total()
        return (
            f"needs {job.lo} ranks x ({_fmt(job.shape.cpus)} CPU, {_fmt(job.shape.gpus)} GPU) but the whole "
            f"cluster ({len(empty.nodes)} nodes, {_fmt(cpus)} CPUs, {_fmt(gpus)} GPUs) holds at most {fit}"
        )
    excess = quota_excess(quota, _Usage(), job.shape, job.lo)
    if excess is not None:
        return f"tenant {job.tenant} quota: " + excess.replace("at its quota: 0", "0", 1)
    return None


def _dominant_share(usage: _Usage, totals: tuple[float, float]) -> float:
    cpus, gpus = totals
    return max(usage.cpus / cpus if cpus else 0.0, usage.gpus / gpus if gpus else 0.0)


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
    queued: Sequence[Job], usage: Mapping[str, _Usage], totals: tuple[float, float], now: float, policy: Policy
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
    queued: Sequence[Job], usage: Mapping[str, _Usage], totals: tuple[float, float], now: float, policy: Policy
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
    cluster = _Cluster(nodes, running)
    totals = cluster.total()
    usage: dict[str, _Usage] = {}
    for r in running:
        usage.setdefault(r.job.tenant, _Usage()).add(r.job.shape, r.ranks)
    decision = Decision()
    order = queue_order(queued, usage, totals, now, policy)
    head: Job | None = None  # the first job that does not fit: it holds a reservation
    backfill = policy.backfill
    ahead_by_priority: dict[int, int] = {}
    position = 0
    for job in order:
        tenant = usage.setdefault(job.tenant, _Usage())
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
            size = _largest_fit(cluster, job, allowed)
            if size:
                placement = cluster.place(job.shape, size)
                cluster.take(job.shape, placement)
                tenant.add(job.shape, size)
                decision.admit.append(Admission(job.id, size, placement))
                continue
            head = job
            position += 1
            reason, room_coming = _make_room(cluster, running, stopping, job, now, policy, decision)
            # The free room now is part of what the head will start on once its victims stop:
            # nothing backfills into it meanwhile.
            backfill = policy.backfill and not room_coming
            decision.waiting[job.id] = Waiting(position, reason)
            ahead_by_priority[job.priority] = ahead_by_priority.get(job.priority, 0) + 1
            continue
        # Behind a reservation only backfill starts: a preemptible job the head may take back.
        if (backfill and job.preemptible) or not policy.reserve:
            size = _largest_fit(cluster, job, allowed)
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
            position, _demand_text(job, cluster) + f"; behind {higher} job(s) of priority >= {job.priority}"
        )
        ahead_by_priority[job.priority] = ahead_by_priority.get(job.priority, 0) + 1
    if policy.grow and head is None:
        _grow(cluster, running, stopping, usage, quotas, decision)
    return decision


def _largest_fit(cluster: _Cluster, job: Job, allowed: int) -> int:
    """The largest size up to `ranks` (and `allowed` by the quota) that fits now (0: none)."""
    return job.size_at_most(min(job.ranks, allowed, cluster.ranks_that_fit(job.shape)))


def _demand_text(job: Job, cluster: _Cluster) -> str:
    return cluster.demand_text(job.shape, job.lo)


def _make_room(
    cluster: _Cluster,
    running: Sequence[Running],
    stopping: set[str],
    job: Job,
    now: float,
    policy: Policy,
    decision: Decision,
) -> tuple[str, bool]:
    """Preempt (shrink, then stop) what `job` may take, fewest and cheapest first, when that frees
    enough for it; return its waiting reason, and whether room is being made for it."""
    need = _demand_text(job, cluster)
    if not policy.preemption:
        return need, False
    pending = [r for r in running if r.job.id in stopping]
    if pending:
        return need + f"; waiting for {len(pending)} job(s) to stop or shrink", True
    candidates = [
        r
        for r in running
        if r.job.preemptible
        and r.job.id not in stopping
        and (effective_priority(r.job, None, policy) < effective_priority(job, now, policy) or r.backfilled_for == job.id)
    ]
    if not candidates:
        return need, False
    def free_after(victims: Mapping[str, int]) -> dict[str, list[float]]:
        """Free room once each victim is at its new size (0: stopped)."""
        free = {n: list(v) for n, v in cluster.free.items()}
        for r in candidates:
            if r.job.id in victims:
                _give_back(free, r.job.shape, _shrunk_placement(r.placement, r.ranks - victims[r.job.id], gone=True))
        return free

    def fits(victims: Mapping[str, int]) -> bool:
        return cluster.ranks_that_fit(job.shape, free_after(victims)) >= job.lo

    victims: dict[str, int] = {}  # job id -> its size after (0: stopped)
    free = {n: list(v) for n, v in cluster.free.items()}  # kept as victims are added
    fit = {n: _fit_on(job.shape, cpu, gpu) for n, (cpu, gpu) in free.items()}  # ranks of `job` per node
    total = [sum(fit.values())]

    def resize(r: Running, size: int) -> None:
        old = victims.get(r.job.id, r.ranks)
        now_on = _shrunk_placement(r.placement, r.ranks - old)
        gone = _shrunk_placement(now_on, old - size, gone=True)
        _give_back(free, r.job.shape, gone)
        for n in gone:
            if n in free:
                new = _fit_on(job.shape, *free[n])
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
        return need + "; preempting every lower-priority job would not free enough", False
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
    for job_id, size in victims.items():
        r = by_id[job_id]
        if size:
            placement = _shrunk_placement(r.placement, r.ranks - size)
            decision.resize.append(Resize(job_id, size, placement, f"shrunk for {job.id} (priority {job.priority})"))
        else:
            reclaimed = r.backfilled_for == job.id
            why = (
                "backfilled ahead of it"
                if reclaimed
                else f"priority {effective_priority(job, now, policy)} > {effective_priority(r.job, None, policy)}"
            )
            decision.preempt.append(Preemption(job_id, f"preempted for {job.id} ({why})", job.id, reclaimed))
    return need + f"; making room: {len(victims)} job(s) preempted or shrunk", True


def _give_back(free: dict[str, list[float]], shape: Shape, placement: Mapping[str, int]) -> None:
    for n, k in placement.items():
        if n in free:
            free[n][0] += k * shape.cpus
            free[n][1] += k * shape.gpus


def _shrunk_placement(placement: Mapping[str, int], give: int, gone: bool = False) -> dict[str, int]:
    """`placement` less `give` ranks, taken from its biggest nodes first (deterministic); with
    `gone`, the ranks given up per node instead."""
    out, taken = dict(placement), {}
    for n, k in sorted(placement.items(), key=lambda kv: (-kv[1], kv[0])):
        take = min(k, give)
        out[n], taken[n] = k - take, take
        give -= take
        if give == 0:
            break
    result = taken if gone else out
    return {n: k for n, k in result.items() if k}


def _grow(
    cluster: _Cluster,
    running: Sequence[Running],
    stopping: set[str],
    usage: dict[str, _Usage],
    quotas: Mapping[str, Quota],
    decision: Decision,
) -> None:
    """Nothing waits for room: elastic jobs below their maximum grow into what is free, the
    highest priority first. Only preemptible ones: a resize is a save of the current step, a
    stop and a restart from that checkpoint, which a job that cannot resume would lose."""
    admitted = {a.job_id for a in decision.admit}
    for r in sorted(running, key=lambda r: (-r.job.priority, r.job.submitted_at)):
        if r.job.id in stopping or r.job.id in admitted or r.ranks >= r.job.hi or not r.job.preemptible:
            continue
        tenant = usage.setdefault(r.job.tenant, _Usage())
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
        decision.resize.append(Resize(r.job.id, r.ranks + more, placement, "grown into free room"))
