"""`resilience.on_rank_failure: replace_replica` on Ray: what a job must look like for its
data-parallel replicas to be fault domains, the engine job one replica runs, and how a replica
of several ranks forms its process group.

A replica is one rank, or with HSDP (`parallel.data_parallel_shard_size` S) one shard group of
S ranks; with `resilience.resize: live` (each replica group a Ray Train run of its own,
workers/replica_fits.py) its tensor- and pipeline-parallel ranks times that: the job must have no
context or expert parallelism. Replica r is Ray world ranks r*S .. r*S+S-1 (shard rank = world rank % S) and runs
the engine as a job of S ranks (its DP=S sharding) on a process group of its own; its ranks read
their share of every global batch as data-parallel ranks r*S + shard rank of replicas*S
(engine/fault_tolerance/replica_quorum.py).

Ray 2.60's replica groups have one worker each (its WorkerGroup builds them with
`replica_group_size=1`), so Ray replaces single workers: each gets Ray's one-rank process group,
which a replica of S > 1 ranks replaces with its own, formed by rounds through the job registry
(`form_replica`, engine/fault_tolerance/replica_group.py). When one rank of such a replica dies, its
peers notice at once (their watchers), leave the quorum and exit as soon as the dead rank's
replacement has joined (Ray 2.60 cannot replace two failed replica groups of one poll); Ray
replaces them as well, and the new round heals from a live replica.
"""

from __future__ import annotations

import os
from datetime import timedelta
from functools import partial
from typing import Any

from engine.jobspec import JobSpec, ResolvedJob, derive_job, resolve_job
from engine.jobspec.demand import replica_size


def replace_replica(spec: JobSpec) -> bool:
    return spec.resilience.on_rank_failure == "replace_replica"


def check_replace_replica(spec: JobSpec) -> str | None:
    """Why this job cannot run with replace_replica (a message naming the field and the fix), or
    None when it can."""
    if not replace_replica(spec):
        return None
    p, r = spec.parallel, spec.resources
    field = "resilience.on_rank_failure: replace_replica"
    # A replica group of tensor- or pipeline-parallel ranks runs as a Ray Train run of its own,
    # which only resize: live does (workers/replica_fits.py); Ray's own replica groups are single
    # workers.
    for name in ("tensor", "pipeline"):
        if getattr(p, name) != 1 and not spec.live_resize:
            return (
                f"{field} with parallel.{name} = {getattr(p, name)} needs resilience.resize: live on an elastic "
                "job (resources.min_ranks set: each replica group, its model-parallel ranks included, is then a "
                f"run of its own); or set parallel.{name}: 1, or resilience.on_rank_failure: restart_group"
            )
    for name in ("context", "expert"):
        if getattr(p, name) != 1:
            return (
                f"{field} needs parallel.{name} = 1 (a replica is one rank, HSDP's "
                f"parallel.data_parallel_shard_size ranks, or with resize: live tensor- and pipeline-parallel "
                f"ranks); set parallel.{name}: 1 or resilience.on_rank_failure: restart_group"
            )
    if p.virtual_pipeline is not None and spec.resilience.lost_replica_share == "redistribute":
        # The survivors run a missing share's microbatches in their step's schedule, and torch's
        # interleaved 1F1B takes only counts that are a multiple of its rounds.
        return (
            f"{field} with resilience.lost_replica_share: redistribute cannot take parallel.virtual_pipeline "
            f"({p.virtual_pipeline}): remove virtual_pipeline, or set lost_replica_share: skip"
        )
    size = replica_size(spec)
    # The job as asked needs two replicas. An elastic job may shrink to one (resources.min_ranks):
    # Ray restarts the group at each new size from the checkpoint, and a failure while one
    # replica runs restarts it (restart_group's way), as a failure of the last replica does.
    # resilience.resize: live: the job's data slots (max_ranks) are what it is grown back to. A
    # job the scheduler relaunched smaller (its restart-based resize: service/scheduling/demand.py
    # sized_spec) keeps its min_ranks and runs pinned at ranks = max_ranks = its new size, which
    # may be one replica; a job asked for with one replica is refused.
    asked = (r.max_ranks or r.ranks) if spec.resilience.resize == "live" else r.ranks
    relaunched = r.min_ranks is not None and r.max_ranks == r.ranks
    if asked < 2 * size and not relaunched:
        need = "resources.ranks >= 2" if size == 1 else f"resources.ranks >= 2 x {size} (the ranks of a replica group)"
        return f"{field} needs at least 2 data-parallel replicas ({need}); use restart_group"
    return None


# How a replica's rank learns where the job's Lighthouse is: Ray Train's torchft backend sets
# TORCHFT_LIGHTHOUSE in every worker (ray 2.60: ray.train.v2._internal.constants.
# TORCHFT_LIGHTHOUSE_ADDR_ENV_VAR), and ours the liveness relay's address beside it
# (workers/trainer.py). The engine takes both as arguments.
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LIVENESS_ENV = "ELASTRON_REPLICA_LIVENESS"


def lighthouse_addresses() -> dict[str, str | None]:
    """ReplicaQuorum's `lighthouse_addr` (host:port) and `liveness_addr` (the relay's, or None),
    from this rank's environment."""
    lighthouse = os.environ.get(LIGHTHOUSE_ENV)
    if not lighthouse:
        raise RuntimeError(f"replace_replica: no torchft Lighthouse address ({LIGHTHOUSE_ENV} is not set)")
    return {"lighthouse_addr": lighthouse, "liveness_addr": os.environ.get(LIVENESS_ENV) or None}


def replica_job(job: ResolvedJob) -> ResolvedJob:
    """The engine job one replica runs: the job on the replica's ranks (its own process group),
    its tensor parallelism kept and sharded over the rest (HSDP's shard group is the replica's
    whole DP group)."""
    return resolve_job(
        derive_job(
            job.spec,
            resources={"ranks": replica_size(job.spec), "min_ranks": None, "max_ranks": None},
            parallel={"data_parallel_shard_size": None},
        )
    )


def slot_membership(slot: int, rank: int, size: int, run: int, timeout: timedelta) -> Any:
    """resilience.resize: live, a replica group of several ranks (HSDP's shard group) in its own
    Ray Train run (workers/replica_fits.py): Ray's process group is already the replica's, so
    no rendezvous is formed; what the quorum needs besides is the store its ranks' torchft
    Managers share (hosted by its first rank, its address broadcast over the group) and a
    replica id new to each run of the slot (`run`). No watchers: a dead rank fails the run, Ray
    Train ends its other ranks, and the driver starts the slot again."""
    import ray
    import torch.distributed as dist

    from engine.fault_tolerance.replica_group import ReplicaMembership

    store, address = None, [None]
    if rank == 0:
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        address = [(host, store.port)]
    dist.broadcast_object_list(address, src=0)
    host, port = address[0]
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    return ReplicaMembership(slot, rank, size, run, host, port, store)


class _RegistryRounds:
    """The job registry's rendezvous methods, called synchronously (replica_group.RoundsClient)."""

    def __init__(self, registry) -> None:
        self.registry = registry

    def join(self, replica: int, shard_rank: int, size: int, address) -> int:
        import ray

        return ray.get(self.registry.replica_join.remote(replica, shard_rank, size, address), timeout=60)

    def round(self, replica: int, number: int) -> dict[str, Any]:
        import ray

        return ray.get(self.registry.replica_round.remote(replica, number), timeout=10)


def form_replica(registry, replica: int, shard: int, size: int, config: dict[str, Any], lost) -> Any:
    """Replace Ray's one-rank process group of this worker with its replica's (`size` ranks),
    formed by rounds through the job registry. `lost.sender`: this rank's telemetry sender once
    there is one, flushed before the process exits because a peer of its round is gone."""
    import ray
    import torch.distributed as dist

    from engine.fault_tolerance.replica_group import exit_process, form_replica_group

    if registry is None:
        raise RuntimeError("replace_replica with data_parallel_shard_size needs the job registry (workers/registry.py)")
    job = config["job"]

    def flush_telemetry() -> None:
        if lost.sender is not None:
            lost.sender.flush(1.0)

    return form_replica_group(
        _RegistryRounds(registry),
        replica,
        shard,
        size,
        backend=dist.get_backend(),
        host=ray.util.get_node_ip_address(),
        # The driver's process-group timeout (workers/driver.py): the watchdog fires first.
        timeout=timedelta(seconds=job.process_group_timeout_s),
        setup_timeout_s=job.setup_timeout_s,
        # How long a rank that lost its peer waits for the peer's replacement before it exits
        # (Ray 2.60 replaces two failed replica groups of one poll badly: replica_group.py).
        replace_wait_s=60.0,
        exit=partial(exit_process, before=flush_telemetry),
    )
