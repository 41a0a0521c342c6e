"""A stored job as the scheduler's decision sees it: its demand (sizes and per-rank resources, from the
spec as run), whether it may be preempted, and the spec it is launched with at its admitted size.

The per-rank rule and the sizes come from engine/jobspec/demand.py, the same functions the workers'
driver uses to ask Ray for the ranks, so the service never counts a job differently from how it
is placed. The demand is computed once, at submission, and kept on the job row (`jobs.demand`);
whether a rank takes a GPU (`resources.device: auto`) is decided against the cluster of the
moment, as the driver decides it when it starts.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

from engine.jobspec import JobSpec
from engine.jobspec.demand import (
    CPUS_PER_RANK,
    fewest_replicas,
    replica_size,
    run_sizes,
    uses_gpu,
)
from engine.jobspec.layout import model_parallel_size
from service.scheduling.model import Job, Node, Shape


@dataclass(frozen=True)
class Demand:
    ranks: int  # where the job starts (resources.ranks)
    sizes: tuple[int, ...]  # every size it runs on, ascending ((ranks,) for a fixed job)
    step: int  # tensor x pipeline x context: an elastic job's sizes are multiples of it
    device: str  # resources.device: auto, cpu or cuda
    cpus: float = CPUS_PER_RANK  # per rank
    # resilience.resize: live: the ranks of one replica group, which the job releases or adds
    # inside its running attempt (service/reconcile/resize.py); 0: resized by a stop and relaunch
    live_group: int = 0

    @property
    def elastic(self) -> bool:
        return len(self.sizes) > 1

    def shape(self, cluster_gpus: float) -> Shape:
        return Shape(cpus=self.cpus, gpus=1.0 if uses_gpu(self.device, cluster_gpus) else 0.0)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["sizes"] = list(self.sizes)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Demand:
        return cls(
            ranks=int(data["ranks"]),
            sizes=tuple(int(s) for s in data["sizes"]),
            step=int(data["step"]),
            device=str(data["device"]),
            cpus=float(data.get("cpus", CPUS_PER_RANK)),
            live_group=int(data.get("live_group", 0)),
        )


# Elastic sizes checked per job at submission (each is one validation, ~1 ms).
MAX_SIZES = 256


def demand_of(spec: JobSpec) -> Demand:
    """The sizes the scheduler may admit the job at: from `resources.ranks` down to `min_ranks`
    (the largest MAX_SIZES candidates). Not above `ranks`: the service starts a job at most
    there and does not grow it (yet)."""
    live = spec.live_resize
    if live:  # every count of whole replica groups: each global batch is split over all slots
        group = replica_size(spec)
        sizes = tuple(k * group for k in range(fewest_replicas(spec), spec.resources.ranks // group + 1))[-MAX_SIZES:]
    else:
        sizes = tuple(run_sizes(spec, upto=spec.resources.ranks, most=MAX_SIZES)) or (spec.resources.ranks,)
    return Demand(
        ranks=spec.resources.ranks,
        sizes=sizes,
        step=replica_size(spec) if live else model_parallel_size(spec.parallel),
        device=spec.resources.device,
        live_group=replica_size(spec) if live else 0,
    )


def stored_demand(demand: dict[str, Any] | None, spec: dict[str, Any]) -> Demand:
    """The row's demand; rows written before the scheduler existed have none: from their spec."""
    if demand:
        return Demand.from_json(demand)
    return demand_of(JobSpec.model_validate(spec))


def may_preempt(spec: JobSpec, checkpoint_path: str | None = None) -> bool:
    """Whether the scheduler may stop this job for another: it allows it (`scheduling.preemptible`)
    and stopping it loses at most the steps since its last checkpoint, because it saves them
    (`checkpoint.path` and `checkpoint.interval`) and resumes from its own (`checkpoint.resume:
    auto`). A job that saves only at the end would start over, so it is never preempted.
    `checkpoint_path`: the path of the spec as run, when the service chose it."""
    c = spec.checkpoint
    path = checkpoint_path or c.path
    return bool(spec.scheduling.preemptible and path and c.interval and c.resume == "auto")


def core_job(
    *,
    job_id: str,
    tenant: str,
    demand: Demand,
    cluster_gpus: float,
    priority: int = 0,
    preemptible: bool = True,
    submitted_at: float = 0.0,
    waited_s: float = 0.0,
    waiting_since: float | None = None,
    yields_to: str | None = None,
) -> Job:
    lo, hi = demand.sizes[0], demand.sizes[-1]
    return Job(
        id=job_id,
        tenant=tenant,
        shape=demand.shape(cluster_gpus),
        ranks=demand.ranks,
        priority=priority,
        submitted_at=submitted_at,
        waited_s=waited_s,
        waiting_since=waiting_since,
        yields_to=yields_to,
        min_ranks=lo if demand.elastic else None,
        max_ranks=hi if demand.elastic else None,
        preemptible=preemptible,
        size_step=demand.step,
    )


def launch_size(demand: Demand, admitted: int) -> int:
    """The largest size the job runs on that is at most what was admitted (the scheduler counts
    multiples of `step`; a multiple may still not validate, e.g. a batch it does not divide)."""
    fitting = [s for s in demand.sizes if s <= admitted]
    return fitting[-1] if fitting else demand.sizes[0]


def trim_placement(placement: dict[str, int], ranks: int) -> dict[str, int]:
    """`placement` cut down to `ranks` ranks, keeping its fullest nodes."""
    out, left = {}, ranks
    for node, k in sorted(placement.items(), key=lambda kv: (-kv[1], kv[0])):
        take = min(k, left)
        if take:
            out[node] = take
        left -= take
    return out


def sized_spec(spec: dict[str, Any], demand: Demand, size: int) -> dict[str, Any]:
    """The spec an elastic job is launched with at its admitted size: `ranks` and `max_ranks`
    pinned to it, so Ray Train never grows it into room the scheduler gave to another job (it
    may still shrink, on a lost node). A fixed job's spec is unchanged. A live-resized job keeps
    its max_ranks (its data slots: the replica groups it may be grown back to) and starts `size`
    ranks' groups; its driver adds groups only when the scheduler says (service/reconcile/resize.py)."""
    if not demand.elastic:
        return spec
    out = copy.deepcopy(spec)
    r = out["resources"]
    r["max_ranks"] = (r.get("max_ranks") or r["ranks"]) if demand.live_group else size
    r["ranks"] = size
    return out


def place_anywhere(nodes: list[Node], free: dict[str, list[float]], shape: Shape, ranks: int) -> dict[str, int]:
    """A placement for a running job the store has none for (launched before the scheduler
    counted it): where its ranks fit in what is left, so its room is counted somewhere."""
    out, left = {}, ranks
    for node in nodes:
        if not node.alive or left == 0:
            continue
        cpu, gpu = free.setdefault(node.id, [node.cpus, node.gpus])
        k = int(cpu // shape.cpus) if shape.cpus > 0 else left
        if shape.gpus > 0:
            k = min(k, int(gpu // shape.gpus))
        k = min(max(k, 0), left)
        if k:
            out[node.id] = k
            free[node.id][0] -= k * shape.cpus
            free[node.id][1] -= k * shape.gpus
            left -= k
    if left and nodes:  # more than is free: count the rest on the first node (over-committed)
        first = next((n.id for n in nodes if n.alive), nodes[0].id)
        out[first] = out.get(first, 0) + left
    return out
