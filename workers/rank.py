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
from datetime import timedelta
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


class ReleaseWatch:
    """resilience.resize: live: polls the job registry for the driver's release of this replica
    slot (workers/replica_fits.py), off the training thread; `asked` is the engine's should_leave.
    `stepped`: this group has reported its first step (a grow is done once it steps)."""

    POLL_S = 0.25

    def __init__(self, registry, slot: int) -> None:
        self.registry, self.slot = registry, slot
        self.asked = threading.Event()
        self.stepped = False
        self._stop = threading.Event()

    def start(self, poll: bool = True) -> ReleaseWatch:
        """`poll`: this rank asks the registry (a replica's first rank only: the engine agrees the
        release over the replica's ranks, engine/fault_tolerance/replica_quorum.py `leave_agreed`,
        so one asker per group keeps the registry's load at one call per group per POLL_S)."""
        if poll:
            threading.Thread(target=self._run, name="elastron-release-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import ray

        while not self._stop.wait(self.POLL_S):
            try:
                if ray.get(self.registry.released.remote(self.slot), timeout=5):
                    self.asked.set()
                    return
            except Exception:  # noqa: BLE001 - the registry busy or gone: ask again
                continue


def rank_main(config: dict[str, Any]) -> dict[str, Any] | None:
    """Train this rank of the job (Ray Train's train_loop_per_worker)."""
    entered = time.time()
    # What a rank needs, imported here (a warm process has them already: workers/warm_processes.py),
    # timed for the restart's breakdown.
    import ray.train  # noqa: F401
    import torch.distributed  # noqa: F401

    import engine.checkpointing.recovery  # noqa: F401
    import engine.fault_tolerance.replica_quorum  # noqa: F401
    import engine.rank_hooks  # noqa: F401
    import engine.train_loop  # noqa: F401
    import engine.watchdog  # noqa: F401
    import workers.fencing  # noqa: F401
    import workers.replicas  # noqa: F401
    import workers.snapshots  # noqa: F401
    import workers.telemetry  # noqa: F401
    import workers.warm_processes  # noqa: F401

    run = RankRun(config, entered, imports_s=time.time() - entered)
    return run.train()


class RankRun:
    """One rank of one attempt, in the order it happens: who it is and on what device
    (`__init__`), meeting its group (`_meet`), its replica under replace_replica
    (`_join_replica`), its telemetry (`_start_telemetry`), the watchdog, snapshots and quorum
    around the engine (`_guards`), then `train`. The engine's hooks (`_on_trainer`,
    `_on_record`) are its methods: what they share is on the instance, not in closures."""

    def __init__(self, config: dict[str, Any], entered: float, imports_s: float) -> None:
        import ray.train

        from engine.rank_hooks import RankIdentity
        from workers.replicas import replace_replica, replica_size

        self.config, self.entered, self.imports_s = config, entered, imports_s
        self.job_id, self.attempt = config["job_id"], config["attempt"]
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.hardware = _bind_device(config["device"], ctx.get_local_world_size())
        self.job: ResolvedJob = config["job"]
        # replace_replica: this rank is shard rank `shard` of data-parallel replica `replica` (of
        # `count`), which runs on a process group of its own (workers/replicas.py); the engine
        # sees a job of the replica's ranks (one, or HSDP's shard group).
        self.replicas = replace_replica(self.job.spec)
        # resilience.resize: live: this run is one replica group, slot `replica_slot` of
        # `replica_slots` (workers/replica_fits.py): its process group is Ray's, of its ranks only.
        self.slot = config.get("replica_slot")
        if self.slot is not None:
            self.size = self.world
            self.replica, self.shard, self.count = self.slot, self.rank, config["replica_slots"]
        else:
            self.size = replica_size(self.job.spec) if self.replicas else 1
            self.replica, self.shard, self.count = self.rank // self.size, self.rank % self.size, self.world // self.size
        self.job_rank = self.replica * self.size + self.shard if self.replicas else self.rank
        self.identity = RankIdentity(
            node_id=self.hardware,
            job_id=self.job_id,
            rank=self.shard if self.replicas else self.rank,
            world_size=self.size if self.replicas else self.world,
        )
        self.membership = None  # an HSDP replica's own process group (replica_group.py)
        self.progress_sent_at = 0.0

    def _meet(self) -> None:
        """Who runs where (every rank's node and pid), and this worker group's number in the job
        (restarts and resizes each start one), from the job registry."""
        import ray
        import torch.distributed as dist

        self.me = {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "hardware": self.hardware,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            # Whether the rank ran in a process started ahead (workers/warm_processes.py) or one
            # Ray started for it: /proc's clock, comparable with other processes' on the node.
            "process_started_at": process_started_at(),
        }
        self.everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(self.everyone, self.me)
        self.registry = _registry(self.job_id)
        self.group = None
        if self.rank == 0 and self.registry is not None:
            self.group = ray.get(self.registry.group_started.remote(self.attempt, self.everyone))
            if self.slot is not None:  # where this replica group runs, for the driver's `resized`
                ranks = [{**r, "rank": self.slot * self.size + r["rank"]} for r in self.everyone]
                ray.get(self.registry.replica_placed.remote(self.slot, ranks))

    def _join_replica(self) -> None:
        """The engine's job and data-parallel size: under replace_replica the replica's (an HSDP
        replica first forms its own process group), else the job at this group's size."""
        import ray

        from workers.replicas import form_replica, replica_job, slot_membership

        # Closed over by the replica's watchers (a peer gone: this rank exits too, its telemetry
        # delivered first where it can be).
        self.lost = SimpleNamespace(sender=None)
        if self.replicas and self.size > 1 and self.slot is None:
            self.membership = form_replica(self.registry, self.replica, self.shard, self.size, self.config, self.lost)
        elif self.replicas and self.size > 1:  # a live job's replica group: Ray's group is the replica's
            timeout = timedelta(seconds=self.job.process_group_timeout_s)
            self.membership = slot_membership(self.slot, self.shard, self.size, self.config["replica_run"], timeout)
        if self.replicas and self.config["device"] == "cpu":
            # Ray's replica groups each count one local rank, so _bind_device gave this rank every
            # core of the node, which the node's other replicas (and a replica's other ranks)
            # share: the CPUs Ray assigned it.
            import torch

            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
            torch.set_num_threads(max(1, int(cpus)))
        if self.replicas:  # the job's DP: its replica groups' (tensor-parallel ranks read one share)
            self.job = replica_job(self.job)
            self.dp = self.count * self.job.data_parallel_size
        else:
            if self.job.spec.resources.ranks != self.world:  # an elastic group of another size
                self.job = self.job.with_ranks(self.world)
            self.dp = self.job.data_parallel_size
        self.spec = self.job.spec

    def _start_telemetry(self) -> None:
        """This rank's telemetry sender, and its start announced: each replica's own, or the
        group's (rank 0) with every rank's node."""
        import ray

        from workers.fencing import exit_fenced
        from workers.telemetry import TelemetrySender

        fallback = ray.get(self.registry.telemetry_settings.remote()) if self.registry is not None else {}
        sender = self.sender = TelemetrySender.from_env(
            self.job_id,
            f"rank-{self.rank}",
            fallback,
            flush_interval_s=self.config.get("flush_interval_s", 1.0),
            event_defaults={"attempt": self.attempt},
            on_fenced=exit_fenced,  # a newer attempt runs: stop now, unsaved (workers/fencing.py)
        )
        sender.start()
        self.lost.sender = sender
        if self.replicas:  # each replica's start (a replaced one: in a warm process or not)
            sender.event(
                contract.EVENT_REPLICA_STARTED,
                replica=self.replica,
                replicas=self.count,
                # the job's ranks (the service's placement counts one rank each)
                world_size=self.count * self.size,
                group=self.group,
                **({"shard_rank": self.shard, "round": self.membership.round} if self.membership is not None else {}),
                **({"slot": self.slot} if self.slot is not None else {}),
                # How long this process existed before it ran the rank: seconds for one started
                # ahead (a warm process) or for a cold one's own imports alike; read with the
                # replacement's start time, which only the controller knows.
                process_age_s=round(self.entered - (process_started_at() or self.entered), 3),
                **{contract.RANKS: [{**self.me, "rank": self.job_rank}]},
            )
        elif self.rank == 0:
            sender.event(
                contract.EVENT_RANKS_STARTED,
                group=self.group,
                world_size=self.world,
                data_parallel_size=self.dp,
                nodes=sorted({r["node_id"] for r in self.everyone}),
                **{contract.RANKS: self.everyone},
            )

    def _report_own_failure(self, kind: str, message: str) -> None:
        """The rank is about to kill itself: its event, and its message for the driver's cause."""
        import ray

        self.sender.event(
            kind, rank=self.rank, message=message, **({"replica": self.replica} if self.replicas else {})
        )
        if self.registry is not None:
            with contextlib.suppress(Exception):
                ray.get(self.registry.report_watchdog.remote(self.attempt, self.rank, os.getpid(), message), timeout=5)
        self.sender.flush(3)

    def _on_lighthouse_lost(self, message: str) -> None:
        """replace_replica: the replica's link saw the Lighthouse's process end (replica_quorum.py)."""
        if not _STATE.shutting_down.is_set():  # a group Ray shuts down loses it on purpose
            self.watchdog.fail(
                message, report=lambda m: self._report_own_failure(contract.EVENT_LIGHTHOUSE_LOST, m)
            )

    def _guards(self) -> None:
        """What runs beside the engine: the step watchdog, the in-memory snapshots' pusher
        (restart_group with checkpoint.local_interval), the replicas' quorum (replace_replica:
        a replaced replica heals from a live peer instead of a snapshot)."""
        from engine.fault_tolerance.replica_quorum import ReplicaQuorum
        from engine.watchdog import StepWatchdog
        from workers.replicas import lighthouse_addresses
        from workers.snapshots import SnapshotPusher

        spec, job, registry, attempt = self.spec, self.job, self.registry, self.attempt
        self.pusher = None
        if spec.checkpoint.local_interval and registry is not None and not self.replicas:
            nodes = [r["node_id"] for r in self.everyone]
            self.pusher = SnapshotPusher(
                self.job_id, self.rank, self.me["node_id"], nodes, spec.checkpoint.local_replicas, registry
            )
        self.quorum = None
        if self.replicas:
            self.quorum = ReplicaQuorum(
                self.replica,
                self.count,
                # a replica group's own run gets them from the driver, Ray's from its environment
                **(self.config.get("lighthouse") or lighthouse_addresses()),
                group=self.membership,
                timeout_s=job.quorum_timeout_s,
                startup_wait_s=job.setup_timeout_s,
                peers_finished=lambda: _replicas_ended(registry, attempt),
                heartbeat_timeout_ms=spec.resilience.replica_heartbeat_timeout_ms,
                on_lighthouse_lost=self._on_lighthouse_lost,
                last_progress=lambda: _last_progress(registry),
                redistribute=spec.resilience.lost_replica_share == "redistribute",
                expect=self.config.get("replicas_expected"),
            )
        self.release = None
        if self.slot is not None and registry is not None:
            self.release = ReleaseWatch(registry, self.slot).start(poll=self.shard == 0)
        self.watchdog = StepWatchdog(
            spec.resilience.step_timeout_s,
            setup_timeout_s=job.setup_timeout_s,
            on_timeout=lambda message: self._report_own_failure(contract.EVENT_WATCHDOG_TIMEOUT, message),
        ).start()

    def _on_trainer(self, trainer) -> None:
        """The engine built its Trainer (and resumed from the persistent checkpoint): resume from
        newer in-memory snapshots where there are, watch its steps, report the recovery."""
        from engine.checkpointing.recovery import recover
        from workers.fencing import commit_guard
        from workers.snapshots import HolderStore
        from workers.warm_processes import prestart_after_first_step

        _STATE.trainer = trainer
        if self.rank == 0 and trainer.checkpointer is not None:
            trainer.checkpointer.before_commit = commit_guard(self.sender)
        built = time.time()
        recovery = {"recovered_from": "persistent", "iteration": trainer.iteration, "agree_s": 0.0, "restore_s": 0.0}
        if self.pusher is not None:
            trainer.phase = "recover"
            recovery = recover(trainer, HolderStore(self.job_id, self.me["node_id"]))
        self.watchdog.watch(trainer)
        if self.job.warm_restart:
            prestart_after_first_step(trainer)
        restarted = self.attempt > 0 or (self.group or 0) > 0
        if self.rank == 0 and not self.replicas and (restarted or trainer.iteration > 0):
            self._send_recovered(trainer, recovery, built)

    def _send_recovered(self, trainer, recovery: dict, built: float) -> None:
        """Rank 0 of a restarted group: where the state came from, the steps lost, and what each
        phase of the restart cost."""
        from workers.warm_processes import process_was_warm

        reached = _last_progress(self.registry)
        started_at = self.config.get("attempt_started_at")
        process_at = process_started_at()
        entered = self.entered
        split = started_at is not None and process_at is not None and started_at <= process_at <= entered
        phases = {
            "group_start": round(entered - started_at, 3) if started_at else None,
            # group_start = until the rank's process exists (Ray Train's controller, placement
            # group, actor scheduling) + the worker's own start (Python, Ray, torch and Ray
            # Train imports, the torch process group, the train context)
            "until_rank_process": round(process_at - started_at, 3) if split else None,
            "rank_process_start": round(entered - process_at, 3) if split else None,
            "imports": round(self.imports_s, 3),
            "process_group_and_registry": round(self.setup_started - entered - self.imports_s, 3),
            "build_and_persistent_resume": round(built - self.setup_started, 3),
            "agree": round(recovery["agree_s"], 3),
            "restore": round(recovery["restore_s"], 3),
        }
        self.sender.event(
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
            group=self.group,
            world_size=self.world,
        )

    def _on_record(self, record: dict) -> None:
        """One step's metrics record: to the registry (how far the job got) and the control plane."""
        if self.release is not None and not self.release.stepped:  # a live grow is done when it steps
            self.release.stepped = True
            self.registry.replica_stepping.remote(self.slot)
        if self.quorum is not None and self.quorum.participating_rank != 0:
            return  # the replica that is first in the step's quorum reports it
        # How far the job got, for the steps a restart loses (no wait): every step under
        # restart_group; under replace_replica, where only the fallback to the checkpoint reads
        # it, at most once a REPLICA_PROGRESS_EVERY_S (one actor call per step was 0.065 cores
        # of the 2-core SMALL survive bench).
        now = time.time()
        if self.registry is not None and (self.quorum is None or now - self.progress_sent_at >= REPLICA_PROGRESS_EVERY_S):
            self.registry.progress.remote(record["iteration"], now)
            self.progress_sent_at = now
        self.sender.record(
            {
                **record,
                contract.RECORD_ATTEMPT: self.attempt,
                contract.RECORD_GROUP: self.group,
                contract.RECORD_WORLD_SIZE: self.world,
                contract.RECORD_DATA_PARALLEL_SIZE: self.dp,
                contract.RECORD_TS: time.time(),
            }
        )
        # The record of a step that checkpointed is the one a resume never redoes: deliver it
        # now (one POST per checkpoint), so even a hard kill of this rank cannot lose it.
        interval = self.spec.checkpoint.interval
        if interval and record["iteration"] % interval == 0:
            self.sender.flush(2.0)
        if _STATE.shutting_down.is_set():  # stop at this step boundary until Ray kills the group
            self.sender.flush(2.0)
            _STATE.frozen.set()
            time.sleep(FREEZE_LIMIT_S)  # Ray kills this process within seconds
            raise RuntimeError("the worker group was shut down but this worker was not stopped")

    def train(self) -> dict[str, Any] | None:
        """Set up, run the engine's train_rank, clean up; rank 0's last record for the driver."""
        self._meet()
        self._join_replica()
        self._start_telemetry()
        self._guards()
        self.setup_started = time.time()
        records = self._run_engine()
        if self.rank != 0:
            return None
        last = records[-1] if records else {}
        return {"iteration": last.get("iteration"), "loss": last.get("loss"), "steps": len(records), "time": time.time()}

    def _run_engine(self) -> list[dict]:
        from engine.rank_hooks import RankHooks
        from engine.train_loop import train_rank

        sender, pusher, rank = self.sender, self.pusher, self.rank
        finished = False
        _STATE.sender, _STATE.rank = sender, rank
        _STATE.shutting_down.clear()
        _STATE.frozen.clear()
        _STATE.running.set()
        try:
            self.watchdog.watch(_SETTING_UP)
            records = train_rank(
                self.job,
                self.config.get("metrics_out") if rank == 0 else None,
                self.config.get("quiet", False),
                hooks=RankHooks(
                    on_trainer=self._on_trainer,
                    on_record=self._on_record if rank == 0 or self.replicas else None,
                    on_snapshot_due=pusher.snapshot if pusher is not None else None,
                    on_event=sender.forward_event,
                    # Rank 0's sender hears the scheduler's "stop" in its batches' answers; every
                    # rank takes part in agreeing on it (the others answer False).
                    should_stop=sender.stop_requested.is_set,
                    should_leave=self.release.asked.is_set if self.release is not None else None,
                    quorum=self.quorum,
                ),
                identity=self.identity,
            )
            finished = True
            left = self.quorum is not None and self.quorum.left  # released (a live shrink): the job goes on
            if self.replicas and self.registry is not None and not left:  # a replacement joining must not wait for us
                self.registry.replica_ended.remote(self.attempt)
            if self.membership is not None:  # its peers' watchers of this rank end quietly
                self.membership.close()
            return records
        except BaseException:
            if self.membership is not None:  # a peer died: exit once it was replaced (replica_group.py)
                self.membership.hold_if_lost()
            raise
        finally:
            if pusher is not None:
                pusher.wait()
            _STATE.running.clear()
            self.watchdog.stop()
            if self.release is not None:
                self.release.stop()
            _STATE.trainer = None
            # A failing rank does not hold up the restart for an unreachable control plane: what
            # is not delivered within a few seconds stays in the spool.
            if not sender.close(10.0 if finished else 3.0) and sender.enabled:
                print(
                    f"[elastron] telemetry from rank {rank} is spooled in {sender.spool_path} "
                    f"({sender.last_error}); it is re-sent by the next process of this rank on this node",
                    file=sys.stderr,
                    flush=True,
                )
