"""The per-rank function Ray Train runs in each worker actor: the engine's `train_rank`, plus
only what Ray needs.

Ray Train has already created the torch process group (gloo on CPU, NCCL on GPU, its timeout
from the driver's TorchConfig) when this runs; the engine builds parallel_state on top of it,
resumes from the newest committed checkpoint in the job's storage, and trains. Around that
call this function:

1. binds the device (the GPU Ray assigned, or CPU threads split between the node's ranks) and
   hands `train_rank` the rank's identity (engine/rank_hooks.py `RankIdentity`): the Ray node
   id (plus the GPU id on CUDA) is what the rerun state machine compares to tell "other
   hardware";
2. gathers who runs where (node, pid) and registers the group with the job registry;
3. starts a telemetry sender: rank 0 forwards every metrics record (with `attempt`, `group`,
   `world_size`, `data_parallel_size`, `ts`); every rank forwards every event its engine
   records (`RankHooks.on_event`, an in-process call);
4. starts the step watchdog (resilience.step_timeout_s) on the engine's Trainer, which
   `train_rank` hands over through `RankHooks.on_trainer` (setup, before the Trainer exists, is
   watched on a stand-in); on a hang it leaves its message with the registry and kills the
   process, so the group restarts;
5. when Ray shuts the group down (resize, cancel), stops rank 0 at a step boundary and delivers
   the telemetry (`on_worker_shutdown`, called from a Ray Train worker callback);
6. with `checkpoint.local_interval`: pushes in-memory snapshots to the node holders from a
   background thread (workers/snapshots.py), and on start resumes from the newest one every
   rank has (engine/checkpointing/recovery.py, through the holders' `HolderStore`), rank 0
   sending the `recovered` event with its phases;
7. returns rank 0's last record, which the driver reports as the job's outcome.

With `resilience.on_rank_failure: replace_replica` each rank belongs to a data-parallel replica
(workers/replicas.py): the engine runs the replica's job on the replica's own process group
(Ray's one-rank group, or for HSDP replicas of S ranks a group formed through the job registry,
which replaces Ray's) and takes part in the job's torchft quorum (`ReplicaQuorum`).

The job arrives typed and resolved (`engine.jobspec.ResolvedJob`, made once by the driver);
only an elastic group of another size resolves it again, on its rank count.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

from engine.jobspec import ResolvedJob, contract


class _RankState:
    """What this worker process is doing, for Ray's worker-shutdown callback (another thread)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.sender: Any = None
        self.rank: int | None = None
        self.running = threading.Event()  # the training loop is in progress
        self.shutting_down = threading.Event()  # Ray is shutting this worker group down
        self.frozen = threading.Event()  # rank 0 stopped at a step boundary, telemetry sent


_STATE = _RankState()

# Ray Train gives workers 5 s between "shut down" and the kill
# (worker_group/state.py: _shutdown_workers(patience_s=5)); we stay inside it.
SHUTDOWN_GRACE_S = 4.0
FREEZE_LIMIT_S = 120.0
# replace_replica: how often the quorum's first replica tells the registry its step. A fallback
# to the persistent checkpoint (every replica dead) counts its steps lost from it, so it may
# count up to this long's steps too few; restart_group reports every step.
REPLICA_PROGRESS_EVERY_S = 1.0

# What the watchdog watches while train_rank builds the Trainer (model, data, resume), which can
# hang in a collective as well as a step can: the phase given the setup budget, no iteration.
_SETTING_UP = SimpleNamespace(iteration=None, phase="setup")


def on_worker_shutdown() -> None:
    """Ray is about to kill this worker (a resize, a cancel, or the end of a failed attempt).

    Rank 0 stops at the next step boundary (after the step's checkpoint, if one is due, has
    committed) and delivers its telemetry, so the records a resize or cancel would lose arrive and
    no checkpoint commits behind the last record; a checkpoint still being written in the
    background gets the rest of the grace period. Then every rank delivers what its sender still
    holds within that period, rank 0 too: when the loop has already failed (a peer died), its
    own closing flush runs concurrently and Ray's kill would otherwise cut it short, losing the
    record of the step that just saved its checkpoint."""
    state = _STATE
    state.shutting_down.set()
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    while time.monotonic() < deadline and state.running.is_set():
        checkpointer = getattr(state.trainer, "checkpointer", None)
        saving = checkpointer is not None and checkpointer.saving
        if (state.rank != 0 or state.frozen.is_set()) and not saving:
            break
        time.sleep(0.02)
    if state.sender is not None:
        state.sender.flush(max(0.1, deadline - time.monotonic()))


def _bind_device(device_type: str, local_world_size: int) -> str:
    """Bind this process to its device; return its hardware identity for the rerun machine."""
    import ray
    import ray.train.torch
    import torch

    from engine import device

    node_id = ray.get_runtime_context().get_node_id()
    if device_type == "cuda":
        dev = ray.train.torch.get_device()
        device.set_device("cuda", dev.index or 0)
        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU") or []
        return f"{node_id}/gpu{gpus[0]}" if gpus else node_id
    device.set_device("cpu")
    torch.set_num_threads(device.cpu_threads_per_rank(local_world_size))
    return node_id


def process_started_at(pid: int | str = "self") -> float | None:
    """When a process started (epoch seconds; Linux /proc), to split a restart's group start
    into "until the rank's process exists" and "the process' own start-up"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _registry(job_id: str):
    import ray

    from workers.registry import NAMESPACE, registry_name

    try:
        return ray.get_actor(registry_name(job_id), namespace=NAMESPACE)
    except ValueError:
        return None


def _last_progress(registry) -> int | None:
    """The job's newest step reported to its registry (None: none, or the registry did not
    answer): what a resume from the persistent checkpoint lost counts from it."""
    import ray

    if registry is None:
        return None
    try:
        return ray.get(registry.last_progress.remote(), timeout=5)
    except Exception:  # noqa: BLE001 - the count is for the record; the resume goes on
        return None


def _replicas_ended(registry, attempt: int) -> bool:
    """replace_replica: whether the replicas of this attempt left the training loop (the job's
    last step, or a preemption's stop): a replacement that joins after that has nothing left to
    train, and waiting for its peers would hold the job's end (or its preemption) up."""
    import ray

    if registry is None:
        return False
    try:
        return ray.get(registry.replicas_ended.remote(attempt), timeout=5)
    except Exception:  # noqa: BLE001 - the registry is busy or gone: keep waiting for peers
        return False


def rank_main(config: dict[str, Any]) -> dict[str, Any] | None:
    """Train this rank of the job (Ray Train's train_loop_per_worker)."""
    entered = time.time()
    import ray
    import ray.train
    import torch.distributed as dist

    from engine.checkpointing.recovery import recover
    from engine.distributed.replica_quorum import ReplicaQuorum
    from engine.rank_hooks import RankHooks, RankIdentity
    from engine.train_loop import train_rank
    from engine.watchdog import StepWatchdog
    from workers.fencing import commit_guard, exit_fenced
    from workers.replicas import (
        form_replica,
        lighthouse_addresses,
        replace_replica,
        replica_job,
        replica_size,
    )
    from workers.snapshots import HolderStore, SnapshotPusher
    from workers.telemetry import TelemetrySender
    from workers.warm_processes import prestart_after_first_step, process_was_warm

    imports_s = time.time() - entered

    job_id, attempt = config["job_id"], config["attempt"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    hardware = _bind_device(config["device"], ctx.get_local_world_size())
    job: ResolvedJob = config["job"]
    # replace_replica: this rank is shard rank `shard` of data-parallel replica `replica` (of
    # `count`), which runs on a process group of its own (workers/replicas.py); the engine sees
    # a job of the replica's ranks (one, or HSDP's shard group).
    replicas = replace_replica(job.spec)
    size = replica_size(job.spec) if replicas else 1
    replica, shard, count = rank // size, rank % size, world // size
    identity = RankIdentity(
        node_id=hardware,
        job_id=job_id,
        rank=shard if replicas else rank,
        world_size=size if replicas else world,
    )

    me = {
        "rank": rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "hardware": hardware,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    registry = _registry(job_id)
    group = None  # this worker group's number in the job (restarts and resizes each start one)
    if rank == 0 and registry is not None:
        group = ray.get(registry.group_started.remote(attempt, everyone))

    # Closed over by the replica's watchers (a peer gone: this rank exits too, its telemetry
    # delivered first where it can be).
    lost = SimpleNamespace(sender=None)
    membership = form_replica(registry, replica, shard, size, config, lost) if replicas and size > 1 else None
    if replicas and config["device"] == "cpu":
        # Ray's replica groups each count one local rank, so _bind_device gave this rank every
        # core of the node, which the node's other replicas (and a replica's other ranks) share:
        # the CPUs Ray assigned it.
        import torch

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        torch.set_num_threads(max(1, int(cpus)))

    if replicas:
        job, dp = replica_job(job), world
    else:
        if job.spec.resources.ranks != world:  # an elastic group of another size
            job = job.with_ranks(world)
        dp = job.data_parallel_size
    spec = job.spec

    fallback = ray.get(registry.telemetry_settings.remote()) if registry is not None else {}
    sender = TelemetrySender.from_env(
        job_id,
        f"rank-{rank}",
        fallback,
        flush_interval_s=config.get("flush_interval_s", 1.0),
        event_defaults={"attempt": attempt},
        on_fenced=exit_fenced,  # a newer attempt runs: stop now, unsaved (workers/fencing.py)
    )
    sender.start()
    lost.sender = sender
    if replicas:  # each replica's start (a replaced one: in a warm process or not)
        sender.event(
            contract.EVENT_REPLICA_STARTED,
            replica=replica,
            replicas=count,
            world_size=world,  # Ray's workers in the group, the service's placement (one rank each)
            group=group,
            **({"shard_rank": shard, "round": membership.round} if membership is not None else {}),
            # How long this process existed before it ran the rank: seconds for one started
            # ahead (a warm process) or for a cold one's own imports alike; read with the
            # replacement's start time, which only the controller knows.
            process_age_s=round(entered - (process_started_at() or entered), 3),
            **{contract.RANKS: [{**me, "rank": rank}]},
        )
    elif rank == 0:
        sender.event(
            contract.EVENT_RANKS_STARTED,
            group=group,
            world_size=world,
            data_parallel_size=dp,
            nodes=sorted({r["node_id"] for r in everyone}),
            **{contract.RANKS: everyone},
        )

    def report_own_failure(kind: str, message: str) -> None:
        """The rank is about to kill itself: its event, and its message for the driver's cause."""
        sender.event(kind, rank=rank, message=message, **({"replica": replica} if replicas else {}))
        if registry is not None:
            with contextlib.suppress(Exception):
                ray.get(registry.report_watchdog.remote(attempt, rank, os.getpid(), message), timeout=5)
        sender.flush(3)

    def on_timeout(message: str) -> None:
        report_own_failure(contract.EVENT_WATCHDOG_TIMEOUT, message)

    warm_restart = job.warm_restart
    pusher = (
        SnapshotPusher(
            job_id,
            rank,
            me["node_id"],
            [r["node_id"] for r in everyone],
            spec.checkpoint.local_replicas,
            registry,
        )
        if spec.checkpoint.local_interval and registry is not None and not replicas
        else None
    )

    def on_lighthouse_lost(message: str) -> None:
        """replace_replica: the replica's link saw the Lighthouse's process end (replica_quorum.py)."""
        if not _STATE.shutting_down.is_set():  # a group Ray shuts down loses it on purpose
            watchdog.fail(message, report=report_lighthouse_lost)

    def report_lighthouse_lost(message: str) -> None:
        report_own_failure(contract.EVENT_LIGHTHOUSE_LOST, message)

    # replace_replica: a replaced replica heals from a live peer instead of a snapshot.
    quorum = (
        ReplicaQuorum(
            replica,
            count,
            **lighthouse_addresses(),
            group=membership,
            timeout_s=job.quorum_timeout_s,
            startup_wait_s=job.setup_timeout_s,
            peers_finished=lambda: _replicas_ended(registry, attempt),
            heartbeat_timeout_ms=spec.resilience.replica_heartbeat_timeout_ms,
            on_lighthouse_lost=on_lighthouse_lost,
            last_progress=lambda: _last_progress(registry),
        )
        if replicas
        else None
    )
    setup_started = time.time()

    def on_trainer(trainer) -> None:
        _STATE.trainer = trainer
        if rank == 0 and trainer.checkpointer is not None:
            trainer.checkpointer.before_commit = commit_guard(sender)
        built = time.time()
        recovery = {
            "recovered_from": "persistent",
            "iteration": trainer.iteration,
            "agree_s": 0.0,
            "restore_s": 0.0,
        }
        if pusher is not None:
            trainer.phase = "recover"
            recovery = recover(trainer, HolderStore(job_id, me["node_id"]))
        watchdog.watch(trainer)
        if warm_restart:
            prestart_after_first_step(trainer)
        restarted = attempt > 0 or (group or 0) > 0
        if rank == 0 and not replicas and (restarted or trainer.iteration > 0):
            reached = _last_progress(registry)
            started_at = config.get("attempt_started_at")
            process_at = process_started_at()
            split = started_at is not None and process_at is not None and started_at <= process_at <= entered
            phases = {
                "group_start": round(entered - started_at, 3) if started_at else None,
                # group_start = until the rank's process exists (Ray Train's controller, placement
                # group, actor scheduling) + the worker's own start (Python, Ray, torch and Ray
                # Train imports, the torch process group, the train context)
                "until_rank_process": round(process_at - started_at, 3) if split else None,
                "rank_process_start": round(entered - process_at, 3) if split else None,
                "imports": round(imports_s, 3),
                "process_group_and_registry": round(setup_started - entered - imports_s, 3),
                "build_and_persistent_resume": round(built - setup_started, 3),
                "agree": round(recovery["agree_s"], 3),
                "restore": round(recovery["restore_s"], 3),
            }
            sender.event(
                contract.EVENT_RECOVERED,
                **{
                    contract.RECOVERED_FROM: recovery["recovered_from"],
                    contract.STEPS_LOST: max(0, reached - trainer.iteration) if reached is not None else None,
                    contract.RECOVERY_PHASES: phases,
                },
                iteration=trainer.iteration,
                reached=reached,
                # the rank runs in a process started ahead, imports done (workers/warm_processes.py)
                warm_process=process_was_warm(started_at, process_at),
                group=group,
                world_size=world,
            )

    watchdog = StepWatchdog(
        spec.resilience.step_timeout_s,
        setup_timeout_s=job.setup_timeout_s,
        on_timeout=on_timeout,
    ).start()

    checkpoint_interval = spec.checkpoint.interval

    progress_sent_at = 0.0

    def on_record(record: dict) -> None:
        nonlocal progress_sent_at
        if quorum is not None and quorum.participating_rank != 0:
            return  # the replica that is first in the step's quorum reports it
        # How far the job got, for the steps a restart loses (no wait): every step under
        # restart_group; under replace_replica, where only the fallback to the checkpoint reads
        # it, at most once a REPLICA_PROGRESS_EVERY_S (one actor call per step was 0.065 cores
        # of the 2-core SMALL survive bench).
        now = time.time()
        if registry is not None and (quorum is None or now - progress_sent_at >= REPLICA_PROGRESS_EVERY_S):
            registry.progress.remote(record["iteration"], now)
            progress_sent_at = now
        sender.record(
            {
                **record,
                contract.RECORD_ATTEMPT: attempt,
                contract.RECORD_GROUP: group,
                contract.RECORD_WORLD_SIZE: world,
                contract.RECORD_DATA_PARALLEL_SIZE: dp,
                contract.RECORD_TS: time.time(),
            }
        )
        # The record of a step that checkpointed is the one a resume never redoes: deliver it
        # now (one POST per checkpoint), so even a hard kill of this rank cannot lose it.
        if checkpoint_interval and record["iteration"] % checkpoint_interval == 0:
            sender.flush(2.0)
        if _STATE.shutting_down.is_set():  # stop at this step boundary until Ray kills the group
            sender.flush(2.0)
            _STATE.frozen.set()
            time.sleep(FREEZE_LIMIT_S)  # Ray kills this process within seconds
            raise RuntimeError("the worker group was shut down but this worker was not stopped")

    records: list[dict] = []
    finished = False
    _STATE.sender, _STATE.rank = sender, rank
    _STATE.shutting_down.clear()
    _STATE.frozen.clear()
    _STATE.running.set()
    try:
        watchdog.watch(_SETTING_UP)
        records = train_rank(
            job,
            config.get("metrics_out") if rank == 0 else None,
            config.get("quiet", False),
            hooks=RankHooks(
                on_trainer=on_trainer,
                on_record=on_record if rank == 0 or replicas else None,
                on_snapshot_due=pusher.snapshot if pusher is not None else None,
                on_event=sender.forward_event,
                # Rank 0's sender hears the scheduler's "stop" in its batches' answers; every
                # rank takes part in agreeing on it (the others answer False).
                should_stop=sender.stop_requested.is_set,
                quorum=quorum,
            ),
            identity=identity,
        )
        finished = True
        if replicas and registry is not None:  # a replacement still joining must not wait for us
            registry.replica_ended.remote(attempt)
        if membership is not None:  # its peers' watchers of this rank end quietly
            membership.close()
    except BaseException:
        if membership is not None:  # a peer died: exit once it was replaced (replica_group.py)
            membership.hold_if_lost()
        raise
    finally:
        if pusher is not None:
            pusher.wait()
        _STATE.running.clear()
        watchdog.stop()
        _STATE.trainer = None
        # A failing rank does not hold up the restart for an unreachable control plane: what is
        # not delivered within a few seconds stays in the spool.
        if not sender.close(10.0 if finished else 3.0) and sender.enabled:
            print(
                f"[elastron] telemetry from rank {rank} is spooled in {sender.spool_path} "
                f"({sender.last_error}); it is re-sent by the next process of this rank on this node",
                file=sys.stderr,
                flush=True,
            )
    if rank != 0:
        return None
    last = records[-1] if records else {}
    return {
        "iteration": last.get("iteration"),
        "loss": last.get("loss"),
        "steps": len(records),
        "time": time.time(),
    }
