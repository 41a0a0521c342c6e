"""What a job asks of a cluster: the rank counts it runs on and what one rank takes.

The one home of the per-rank resources rule: the workers' driver asks Ray for exactly this per
rank (workers/driver.py), and the service's scheduler counts the same numbers against the
cluster's capacity (service/scheduling/), so the two never disagree about what a job needs.
Pure arithmetic, no torch, no Ray.
"""

from __future__ import annotations

from engine.jobspec.job import JobSpec, JobSpecError
from engine.jobspec.layout import model_parallel_size

# Logical CPUs one rank reserves on Ray (its process; data loading runs in it too).
CPUS_PER_RANK = 1.0


def uses_gpu(device: str, cluster_gpus: float) -> bool:
    """Whether a rank takes a GPU: `resources.device` cuda, or auto on a cluster that has GPUs."""
    return device == "cuda" or (device == "auto" and cluster_gpus > 0)


def rank_resources(use_gpu: bool, cpus_per_rank: float = CPUS_PER_RANK) -> dict[str, float]:
    """Ray resources of one rank: {"GPU": 1, "CPU": cpus} on GPUs, {"CPU": cpus} otherwise."""
    return {"GPU": 1.0, "CPU": cpus_per_rank} if use_gpu else {"CPU": cpus_per_rank}


def replica_size(spec: JobSpec) -> int:
    """The ranks of one replica group under resilience.on_rank_failure: replace_replica: its
    model-parallel group (tensor parallelism; resize: live only, workers/replicas.py) times HSDP's
    shard group, else one."""
    return model_parallel_size(spec.parallel) * (spec.parallel.data_parallel_shard_size or 1)


def replica_slots(spec: JobSpec) -> int:
    """How many replica groups a live-resized job may run at most: its data shards (each global
    batch is split over this many replicas whatever runs, lost_replica_share deciding who trains
    a missing one's share)."""
    r = spec.resources
    return (r.max_ranks if r.max_ranks is not None else r.ranks) // replica_size(spec)


def fewest_replicas(spec: JobSpec) -> int:
    """The fewest replica groups a live-resized job may shrink to (resources.min_ranks, in groups)."""
    group = replica_size(spec)
    return max(1, -(-(spec.resources.min_ranks or group) // group))


def run_sizes(spec: JobSpec, *, upto: int | None = None, most: int | None = None) -> list[int]:
    """Rank counts the job can run on, ascending: `resources.ranks` for a fixed job; for an elastic
    one the multiples of tensor x pipeline x context in [min_ranks, max_ranks] that validate (only
    the data-parallel size changes). `upto`: none above it; `most`: check only that many of the
    largest candidates (each check validates the job again; the API bounds its work per request)."""
    r = spec.resources
    lo = r.min_ranks if r.min_ranks is not None else r.ranks
    hi = r.max_ranks if r.max_ranks is not None else r.ranks
    if lo == hi:
        return [r.ranks]
    from engine.jobspec.resolved import resolve_job

    job, mp = resolve_job(spec), model_parallel_size(spec.parallel)
    top = min(hi, upto) if upto is not None else hi
    top -= top % mp
    candidates = range(top, lo - 1, -mp)
    if most is not None:
        candidates = candidates[:most]
    sizes = []
    for size in candidates:
        try:
            job.with_ranks(size)
        except JobSpecError:
            continue
        sizes.append(size)
    return sizes[::-1]
