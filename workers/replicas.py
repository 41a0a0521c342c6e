"""`resilience.on_rank_failure: replace_replica` on Ray: what a job must look like for its
data-parallel replicas to be fault domains, and the engine job one replica runs.

Ray Train 2.60's replica groups have one worker each (its WorkerGroup builds them with
`replica_group_size=1`), so a replica is one rank: the job must have no tensor, pipeline,
context or expert parallelism (HSDP's replica dimension over shard groups of several ranks
would need replica groups of several workers, which this Ray cannot replace). Each replica
runs the engine on its own one-rank process group, reading its share of every global batch as
data-parallel rank `index` of `count` (engine/distributed/replica_quorum.py).
"""

from __future__ import annotations

from engine.jobspec import JobSpec, ResolvedJob, resolve_job


def replace_replica(spec: JobSpec) -> bool:
    return spec.resilience.on_rank_failure == "replace_replica"


def check_replace_replica(spec: JobSpec) -> str | None:
    """Why this job cannot run with replace_replica (a message naming the field and the fix), or
    None when it can."""
    if not replace_replica(spec):
        return None
    p, r = spec.parallel, spec.resources
    field = "resilience.on_rank_failure: replace_replica"
    for name in ("tensor", "pipeline", "context", "expert"):
        if getattr(p, name) != 1:
            return (
                f"{field} needs parallel.{name} = 1 (each data-parallel replica is one rank on Ray 2.60); "
                f"set parallel.{name}: 1 or resilience.on_rank_failure: restart_group"
            )
    if (p.data_parallel_shard_size or 1) != 1:
        return (
            f"{field}: replicas of several ranks (HSDP, parallel.data_parallel_shard_size) cannot be replaced "
            "one by one on Ray 2.60; remove data_parallel_shard_size or use restart_group"
        )
    smallest = r.min_ranks if r.elastic and r.min_ranks else r.ranks
    if smallest < 2:
        return f"{field} needs at least 2 data-parallel replicas (resources.ranks >= 2); use restart_group"
    return None


def replica_job(job: ResolvedJob) -> ResolvedJob:
    """The engine job one replica runs: the job on one rank (its own process group)."""
    data = job.spec.model_dump(mode="json")
    resources = data["resources"]
    resources["ranks"] = 1
    for key in ("min_ranks", "max_ranks"):
        resources.pop(key, None)
    data["parallel"]["data_parallel_shard_size"] = None
    return resolve_job(data)
