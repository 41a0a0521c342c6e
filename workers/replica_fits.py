"""`resilience.resize: live`: a job's replica groups as Ray Train runs of their own, so that the
scheduler can resize it inside its running attempt.

Ray Train 2.60 keeps every replica group of one run in one placement group (TorchftConfig's
WorkerGroup reuses the old bundles when it replaces a group) and Ray cannot shrink a placement
group, so a replica released inside such a run would keep its CPUs/GPUs reserved. Here the driver
runs one `TorchTrainer.fit()` per replica slot instead, each in a thread, each with the replica's
S ranks (one, or HSDP's shard group) on a plain TorchConfig: that run's torch process group is the
replica's own, and its placement group is freed when its fit returns. The driver owns the job's
Lighthouse (workers/trainer.py `_LighthouseActor`), which every replica's quorum joins.

- The job has `replica_slots` data shards (max_ranks / S): every global batch is split over that
  many replicas whatever runs, and `lost_replica_share` says who trains a missing one's share
  (`redistribute`: the others; the step then equals the uninterrupted run's).
- A shrink (`resize(n)`, or the scheduler's `TelemetryAck.replicas`): the highest running slots
  are released through the job registry; their ranks leave the quorum at a step boundary
  (engine `RankHooks.should_leave`, workers/rank.py `ReleaseWatch`), their fit returns and its
  resources are free. `resized` once every released run has ended.
- A grow: a new run for the lowest free slot; its replica heals from a live peer and joins.
  `resized` once it has stepped (or, past GROW_DEADLINE_S, with the replicas that did).
- Warm processes (resilience.warm_restart, on by default for a live job; workers/warm_processes.py):
  a replica group's run would start a controller, two helpers the ranks wait for and S rank
  processes, each importing torch (~6 s of a grow here). The driver keeps three controller-side
  processes started ahead on its node (refilled once the runs that took them step) and, once a
  released group's run has ended, asks its nodes for S rank processes: the room a grow will
  take back. Measured on this 2-core machine: a grow 1.2 s from the request to stepping in them,
  6-9 s without (tests/workers/test_ray_live_resize.py).
- A replica group that fails is started again in its slot (each one of resilience.max_restarts;
  it heals from a live peer) when the cluster has room for it, else once room returns. A rerun
  exit, or a failure past the budget, ends the attempt (every run aborted) and goes to the
  driver's restart policy (workers/policy.py) as any attempt's failure does.
- The job ends when the runs end on their own (the last step, or the scheduler's stop, which the
  quorum agrees on so that every replica stops at one step boundary).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from engine.jobspec import contract
from engine.jobspec.demand import fewest_replicas, replica_size, replica_slots
from workers.policy import Outcome, classify

log = logging.getLogger(__name__)

# How long a grow waits for its new replica groups to step before it reports what it got.
GROW_DEADLINE_S = 180.0
# How often the driver asks the control plane for the replica count it wants (an empty batch).
ASK_EVERY_S = 1.0
POLL_S = 0.1
# How long a cancel or a failed attempt waits for its replica groups' runs to end.
ABORT_WAIT_S = 60.0


@dataclass
class Slot:
    """One replica slot: its run, if any, and how the last one ended."""

    index: int
    trainer: Any = None
    thread: threading.Thread | None = None
    state: str = "idle"  # idle | running | released | finished | failed | waiting (for room)
    released: bool = False
    result: dict | None = None
    error: BaseException | None = None
    runs: int = 0  # runs started in this slot (each one's replica id is new to torchft)

    @property
    def running(self) -> bool:
        return self.state == "running"


@dataclass
class Resize:
    """A resize in flight: the slots it releases or starts, and since when."""

    from_replicas: int
    to_replicas: int
    slots: list[int]
    started: float = field(default_factory=time.monotonic)
    nodes: dict[str, int] = field(default_factory=dict)  # a shrink: {node: ranks} it frees

    @property
    def grow(self) -> bool:
        return self.to_replicas > self.from_replicas


class ReplicaFits:
    def __init__(self, driver, attempt: int) -> None:
        spec = driver.spec
        self.driver, self.attempt = driver, attempt
        self.size = replica_size(spec)
        self.count = replica_slots(spec)
        self.fewest = fewest_replicas(spec)
        self.slots = [Slot(i) for i in range(self.count)]
        self.target = max(self.fewest, min(self.count, spec.resources.ranks // self.size))
        self.lock = threading.Lock()
        self.resizing: Resize | None = None
        self.restarts = 0
        self.lighthouse: Any = None
        self.addresses: dict[str, str | None] = {}
        self._asked_at = 0.0
        self.warm = bool(driver.job.warm_restart)
        self._controllers_taken = False  # a run started since the controller-side processes were asked for
        self._warm_checked_at = 0.0

    # ------------------------------------------------------------------ the Lighthouse
    def _ensure_lighthouse(self) -> None:
        """The job's Lighthouse, started (again, if it died) on the driver's node."""
        import ray

        from workers.trainer import start_lighthouse

        if self.lighthouse is not None:
            try:
                ray.get(self.lighthouse.address.remote(), timeout=10)
                return
            except Exception:  # noqa: BLE001 - gone: a new one (its replicas failed on its close)
                self.lighthouse = None
        spec = self.driver.spec
        self.lighthouse = start_lighthouse(
            {"silent_timeout_ms": spec.resilience.replica_heartbeat_timeout_ms, "relay": self.driver.options.replica_relay}
        )
        self.addresses = {
            "lighthouse_addr": ray.get(self.lighthouse.address.remote(), timeout=60),
            "liveness_addr": ray.get(self.lighthouse.liveness_address.remote(), timeout=60) or None,
        }

    # ------------------------------------------------------------------ one slot's run
    def _start(self, slot: Slot, expected: int) -> None:
        """A run for `slot`, whose replica waits for `expected` replicas before its first step."""
        import ray

        self._ensure_lighthouse()
        ray.get(self.driver.registry.release.remote(slot.index, False))
        ray.get(self.driver.registry.controller_started.remote(slot.index, None))  # the last run's is gone
        slot.trainer = self.driver._trainer(
            self.attempt,
            {
                "replica_slot": slot.index,
                "replica_slots": self.count,
                "replicas_expected": expected,
                "lighthouse": dict(self.addresses),
                "replica_run": slot.runs,
            },
        )
        slot.runs += 1
        slot.state, slot.released, slot.result, slot.error = "running", False, None, None
        self._controllers_taken = True
        slot.thread = threading.Thread(target=self._fit, args=(slot, slot.trainer), name=f"replica-{slot.index}", daemon=True)
        slot.thread.start()

    def _fit(self, slot: Slot, trainer) -> None:
        try:
            result = trainer.fit()
        except BaseException as err:  # noqa: BLE001 - the main loop decides
            with self.lock:
                slot.error, slot.state = err, ("released" if slot.released else "failed")
            return
        with self.lock:
            slot.result = result.return_value
            slot.state = "released" if slot.released else "finished"
        try:  # its ranks no longer count where it ran
            self.driver.registry.replica_gone.remote(slot.index)
        except Exception:  # noqa: BLE001
            pass

    def _running(self) -> list[Slot]:
        return [s for s in self.slots if s.running]

    # ------------------------------------------------------------------ resizes
    def resize(self, replicas: int) -> str | None:
        """Go on with `replicas` replica groups: release the highest running slots or start runs in
        the lowest free ones. None when it was taken (or there was nothing to do), else why not
        (also sent as a `resize_refused` event)."""
        why = None
        if replicas < self.fewest:
            why = (
                f"asked for {replicas} replica groups; this job runs at least {self.fewest} "
                f"(resources.min_ranks = {self.driver.spec.resources.min_ranks} ranks, {self.size} a group)"
            )
        elif replicas > self.count:
            why = (
                f"asked for {replicas} replica groups; this job has {self.count} data slots "
                f"(resources.max_ranks = {self.count * self.size} ranks, {self.size} a group)"
            )
        elif self.resizing is not None:
            why = f"asked for {replicas} replica groups while a resize to {self.resizing.to_replicas} is in flight"
        if why is not None:
            self.driver.events.event("resize_refused", replicas=replicas, message=why)
            return why
        if replicas == self.target:
            return None
        running = self._running()
        before, self.target = len(running), replicas
        if replicas < before:
            gone = sorted(running, key=lambda s: s.index)[replicas:]
            for slot in gone:
                slot.released = True
                self.driver.registry.release.remote(slot.index)
            self.resizing = Resize(before, replicas, [s.index for s in gone], nodes=self._nodes_of(gone))
        else:
            free = [s for s in self.slots if not s.running][: replicas - before]
            self.resizing = Resize(before, replicas, [s.index for s in free])
            for slot in free:
                self._start(slot, expected=replicas)
        log.info("elastron: resizing %d -> %d replica groups (slots %s)", before, replicas, self.resizing.slots)
        return None

    def _resize_done(self) -> None:
        """Report a resize in flight that is over: its released runs have ended (their resources
        are free), or its new replica groups have stepped."""
        import ray

        z = self.resizing
        if z is None:
            return
        elapsed = time.monotonic() - z.started
        if z.grow:
            try:
                stepping = set(ray.get(self.driver.registry.replicas.remote(), timeout=5)["stepping"])
            except Exception:  # noqa: BLE001 - ask again on the next poll
                return
            done = all(i in stepping for i in z.slots)
            if not done and elapsed < GROW_DEADLINE_S:
                return
        elif any(self.slots[i].running for i in z.slots):
            return
        elif self.warm and z.nodes:  # before `resized`: nothing of another job starts there yet
            self._warm_ranks(z.nodes)
        self.resizing = None
        placed = ray.get(self.driver.registry.replicas.remote(), timeout=10)["placed"]
        running = self._running()
        ranks = [r for s in running for r in placed.get(s.index, [])]
        self.driver.events.event(
            contract.EVENT_RESIZED,
            live=True,
            from_replicas=z.from_replicas,
            to_replicas=len(running),
            asked_replicas=z.to_replicas,
            from_ranks=z.from_replicas * self.size,
            to_ranks=len(running) * self.size,
            seconds=round(elapsed, 3),
            slots=z.slots,
            **{contract.RANKS: ranks},
        )

    def _nodes_of(self, slots: list[Slot]) -> dict[str, int]:
        """{node: ranks} of `slots`' running groups (empty when the registry does not answer)."""
        import ray

        try:
            placed = ray.get(self.driver.registry.replicas.remote(), timeout=5)["placed"]
        except Exception:  # noqa: BLE001 - a warm process is an optimisation
            return {}
        nodes: dict[str, int] = {}
        for slot in slots:
            for r in placed.get(slot.index, []):
                nodes[r["node_id"]] = nodes.get(r["node_id"], 0) + 1
        return nodes

    def _warm_ranks(self, nodes: dict[str, int]) -> None:
        """Rank processes started ahead on `nodes`, for the grow that takes the room back."""
        from workers.trainer import rank_actor_runtime_env
        from workers.warm_processes import prestart_on, rank_runtime_env

        prestart_on(nodes, rank_actor_runtime_env(rank_runtime_env()), "a grow's replica group")

    def _warm_controllers(self) -> None:
        """Once every running group has stepped after a run started: three controller-side
        processes on the driver's node (the next run's controller, its placement-group cleaner and
        synchronization actor, which its ranks wait for), for the next grow or restart."""
        import ray

        from workers.trainer import WarmControllerProcesses, controller_actor_runtime_env
        from workers.warm_processes import prestart_on

        now = time.monotonic()
        if not (self.warm and self._controllers_taken) or self.resizing is not None or now - self._warm_checked_at < 1.0:
            return
        self._warm_checked_at = now
        try:
            stepping = set(ray.get(self.driver.registry.replicas.remote(), timeout=5)["stepping"])
        except Exception:  # noqa: BLE001 - ask again later
            return
        if not all(s.index in stepping for s in self._running()):
            return
        self._controllers_taken = False
        here = ray.get_runtime_context().get_node_id()
        count = WarmControllerProcesses.PROCESSES_PER_ATTEMPT
        prestart_on({here: count}, controller_actor_runtime_env(), "a replica group's controller")

    def _follow_scheduler(self) -> None:
        """The replica count the control plane wants (TelemetryAck.replicas), asked with an
        empty batch every ASK_EVERY_S."""
        sender = self.driver.events.sender
        if not sender.enabled:
            return
        now = time.monotonic()
        if now - self._asked_at >= ASK_EVERY_S:
            self._asked_at = now
            sender.still_current(2.0)
        wanted = sender.wanted_replicas
        if wanted is not None and wanted != self.target and self.resizing is None:
            self.resize(wanted)

    # ------------------------------------------------------------------ failures
    def _budget_left(self) -> int:
        policy = self.driver.policy
        return policy.max_restarts - policy.restarts_used - self.restarts

    def _room_for_one(self) -> bool:
        """Whether live, usable nodes have free room for one replica group now."""
        return sum(self.driver.free_ranks(self.driver.policy.blocked | self.driver.lost_nodes).values()) >= self.size

    def _on_failure(self, slot: Slot) -> Outcome | None:
        """A replica group's run failed: start it again in its slot (None), or end the attempt
        (its Outcome for the driver's policy)."""
        from ray.train import WorkerGroupError

        err = slot.error
        if isinstance(err, WorkerGroupError):
            causes = classify(err.worker_failures)
            if any(c.kind == "rerun" for c in causes) or self._budget_left() <= 0:
                return Outcome(causes=causes, restarts_spent=self.restarts)
        elif self._budget_left() <= 0:
            return Outcome(error=f"replica {slot.index}: {type(err).__name__}: {err}", restarts_spent=self.restarts)
        self.restarts += 1
        self.driver.events.event(
            "replica_restarting",
            replica=slot.index,
            cause=f"{type(err).__name__}: {err}"[:500],
            restarts_left=self._budget_left(),
        )
        slot.state = "waiting"
        return None

    def _restart_waiting(self) -> None:
        for slot in self.slots:
            if slot.state == "waiting" and slot.index < self.count:
                if len(self._running()) >= self.target:
                    slot.state = "idle"  # the job was shrunk meanwhile: the slot stays free
                elif self._room_for_one():
                    self._start(slot, expected=len(self._running()) + 1)

    def _abort_all(self) -> None:
        """Abort every running group's run at once (a cancel, or the attempt's end on a failure),
        through the controller each announced (workers/trainer.py AnnounceController; a run still
        starting is aborted once its controller has); Ray Train kills their ranks after its
        shutdown patience. Waits up to ABORT_WAIT_S for the runs to end."""
        import ray

        deadline = time.monotonic() + ABORT_WAIT_S
        aborted: set[int] = set()
        while time.monotonic() < deadline:
            with self.lock:
                running = [s.index for s in self.slots if s.running]
            if not running:
                break
            try:
                controllers = ray.get(self.driver.registry.controllers.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - ask again
                controllers = {}
            for index in running:
                if index not in aborted and controllers.get(index) is not None:
                    aborted.add(index)
                    controllers[index].abort.remote()  # the controller exits as it aborts: not awaited
            time.sleep(POLL_S)
        for slot in self.slots:
            if slot.thread is not None:
                slot.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ the attempt
    def run(self) -> tuple[Outcome, dict | None]:
        """Run the attempt until its replica groups end: the driver's `_attempt` for this mode."""
        import ray

        try:
            for slot in self.slots[: self.target]:
                self._start(slot, expected=self.target)
            while True:
                if self.driver.stop.is_set():
                    self._abort_all()
                    return Outcome(cancelled=True), None
                self._follow_scheduler()
                with self.lock:
                    failed = [s for s in self.slots if s.state == "failed"]
                for slot in failed:
                    outcome = self._on_failure(slot)
                    if outcome is not None:
                        self._abort_all()
                        return outcome, None
                self._restart_waiting()
                self._resize_done()
                self._warm_controllers()
                with self.lock:
                    states = [s.state for s in self.slots]
                if "finished" in states and not any(s in ("running", "waiting") for s in states):
                    last = next((s.result for s in self.slots if s.state == "finished" and s.result is not None), None)
                    return Outcome(succeeded=True), last
                time.sleep(POLL_S)
        finally:
            if self.lighthouse is not None:
                try:
                    ray.kill(self.lighthouse)
                except Exception:  # noqa: BLE001
                    pass
