"""Where a job's ranks fit: the free room of each alive node by our own accounting, a gang placed
node by node, and the room a placement gives back when it shrinks.

The rule, and why: a job is admitted only when all its ranks fit in what is free, node by node (a
rank's CPUs and GPUs on one node), so Ray never holds a half-placed job; an elastic job is admitted
at the largest size between its `min_ranks` and `ranks` that fits. Ranks go on the fullest nodes
first: packing keeps whole nodes free for big jobs. `never_fits` is the same arithmetic on an empty
cluster: a job that could not run even there is refused at submission.

Its own module: the arithmetic of room, shared by the decision pass, victim selection and elastic
growth. It decides nothing about who goes first or who gives way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from service.scheduling.model import Job, Node, Quota, Running, Shape
from service.scheduling.quotas import Usage, quota_excess


def fit_on(shape: Shape, cpu: float, gpu: float) -> int:
    """Ranks of `shape` that fit in (cpu, gpu) free on one node."""
    n = int(cpu // shape.cpus) if shape.cpus > 0 else 1 << 30
    if shape.gpus > 0:
        n = min(n, int(gpu // shape.gpus))
    return max(n, 0)


class Cluster:
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
                f"needs {ranks} ranks x ({shape.cpus:g} CPU, {shape.gpus:g} GPU), "
                f"{self.ranks_that_fit(shape)} free"
            )
        return text

    def ranks_that_fit(self, shape: Shape, free: Mapping[str, list[float]] | None = None) -> int:
        if free is None:
            if shape not in self._fits:
                self._fits[shape] = self.ranks_that_fit(shape, self.free)
            return self._fits[shape]
        return sum(fit_on(shape, cpu, gpu) for cpu, gpu in free.values())

    def place(self, shape: Shape, ranks: int, free: Mapping[str, list[float]] | None = None) -> dict[str, int] | None:
        """Ranks per node, fullest nodes first (packing keeps whole nodes free for big jobs)."""
        free = self.free if free is None else free
        out: dict[str, int] = {}
        left = ranks
        order = sorted(free, key=lambda n: (free[n][1], free[n][0], n))
        for n in order:
            k = min(fit_on(shape, *free[n]), left)
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


def largest_fit(cluster: Cluster, job: Job, allowed: int) -> int:
    """The largest size up to `ranks` (and `allowed` by the quota) that fits now (0: none)."""
    return job.size_at_most(min(job.ranks, allowed, cluster.ranks_that_fit(job.shape)))


def need_text(job: Job, cluster: Cluster) -> str:
    """What `job` needs at its smallest size and how much of it is free: a waiting reason."""
    return cluster.demand_text(job.shape, job.lo)


def give_back(free: dict[str, list[float]], shape: Shape, placement: Mapping[str, int]) -> None:
    """Return the room of `placement` (ranks of `shape` per node) to `free`."""
    for n, k in placement.items():
        if n in free:
            free[n][0] += k * shape.cpus
            free[n][1] += k * shape.gpus


def shrunk_placement(placement: Mapping[str, int], give: int, gone: bool = False) -> dict[str, int]:
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


def never_fits(job: Job, nodes: Sequence[Node], quota: Quota | None = None) -> str | None:
    """Why `job` could not run even on an empty cluster within its tenant's quota (the service
    refuses it at submission with a 422 naming these numbers), or None."""
    empty = Cluster(nodes, ())
    fit = empty.ranks_that_fit(job.shape)
    if fit < job.lo:
        cpus, gpus = empty.total()
        return (
            f"needs {job.lo} ranks x ({job.shape.cpus:g} CPU, {job.shape.gpus:g} GPU) but the whole "
            f"cluster ({len(empty.nodes)} nodes, {cpus:g} CPUs, {gpus:g} GPUs) holds at most {fit}"
        )
    excess = quota_excess(quota, Usage(), job.shape, job.lo)
    if excess is not None:
        return f"tenant {job.tenant} quota: " + excess.replace("at its quota: 0", "0", 1)
    return None
