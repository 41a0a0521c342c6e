"""Data-parallel replicas as fault domains (`resilience.on_rank_failure: replace_replica`).

Each replica group runs the engine on its own torch process group (its ranks only: one rank,
or HSDP's shard group of S ranks, formed by engine/fault_tolerance/replica_group.py), and the
data-parallel reduction over the replica dimension goes through torchft's managed,
reconfigurable process group instead of the default group. With S > 1 every rank of a replica
has a Manager (group rank = its shard rank, world S, the replica's store); each shard rank
reduces only its own gradient shard, with the same shard rank of the other replicas, heals
from the same shard rank of a live replica (each rank's snapshot is its own shard state), and
torchft agrees `should_commit` within the replica. A `torchft.Manager` per replica agrees a
quorum with the others through the Lighthouse (engine/fault_tolerance/lighthouse.py: torchft's, with
a liveness relay that drops a replica whose process died at once) for every step; a replica
that died is simply absent from the next quorum (the survivors keep stepping). The quorum is
asked for at the step's start and answered on torchft's thread while the forward and backward
run (its asynchronous quorum). A replica that joins behind the others receives a live peer's
state on that thread meanwhile: the Trainer's in-memory snapshot (weights, optimizer, schedule,
iteration and consumed samples: the data position; engine/checkpointing/memory.py), sent over
the managed group (torchft's PGTransport). It gives zeros to that step's reduction, loads the
state after it, and applies the quorum's gradients to it with its optimizer step, as the peers
do: its own forward and backward of that step, on its old state, are thrown away. The peers wait
for the transfer only where it outlasts their forward and backward.

What a step with fewer replicas means (`resilience.lost_replica_share`): with `skip` the
survivors reduce over their own samples only (AVG over the quorum's participants); the missing
replica's share of that global batch is not trained on and not re-assigned. With
`redistribute` the survivors wait for the step's quorum before its forward, learn which
replicas train it (one SUM of a one-hot vector over the managed group, only in a step that
lacks some), split the missing shares' microbatches between them (`step_shares`) and weight
their gradients by their part of the job, so the average over the quorum is the mean over the
whole global batch, as in the uninterrupted run. Either way `consumed_samples` advances by the
whole global batch, so the data position stays the uninterrupted run's. The step record's
`replicas` says how many replicas a step averaged over (docs/resilience.md).

A step whose reduction failed (a peer died during it) is not committed: `should_commit()`
says no on every survivor, the optimizer is not stepped and the step is taken again with the
new quorum.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.fault_tolerance.lighthouse import LivenessLink
from engine.fault_tolerance.replica_group import shard_grad_views
from engine.fault_tolerance.sync import ReplicaSync, StepShares
from engine.jobspec.contract import (
    EVENT_RECOVERED,
    EVENT_REPLICA_LEFT,
    EVENT_REPLICA_LOST,
    EVENT_REPLICA_REJOINED,
    RECOVERED_FROM,
    STEPS_LOST,
)

if TYPE_CHECKING:
    from engine.fault_tolerance.replica_group import ReplicaMembership

# A replica alone waiting for its peers asks for the quorum again after this long (each ask is a
# Lighthouse round trip; its peers are starting on the same CPUs).
PEER_WAIT_POLL_S = 0.05

# Events: engine/jobspec/contract.py (the healed replica sends replica_rejoined with `heal_s`,
# the first survivor replica_lost, and replica_rejoined with `rejoin_s` since it was missed;
# replicas that all resumed the persistent checkpoint: the first one's `recovered`).


class ServedSnapshot(Protocol):
    """An in-memory snapshot of a replica's state, as the quorum sends and digests it
    (engine/checkpointing/memory.py's HostSnapshot)."""

    iteration: int
    payload: Any  # the state's bytes, digested
    block: Any  # the buffer it was captured into (`block.obj`), reused by the next capture

    def seal(self) -> memoryview: ...


class EventSink(Protocol):
    """The rank's event record (engine/rerun/event_log.py's EventLog, a floor above)."""

    def append(self, kind: str, **fields: Any) -> Any: ...


class ReplicaState(Protocol):
    """What the quorum uses of the Trainer it is attached to: the iteration torchft's step follows,
    the rank's event record (the default `emit`), and the state a peer heals from or this replica
    heals into, as an in-memory snapshot. The Trainer (engine/training.py) holds the quorum and
    drives it; the quorum, a floor below, sees it only as this."""

    iteration: int
    events: EventSink

    def capture_snapshot(self, buffer: bytearray | None = None) -> ServedSnapshot: ...

    def restore_snapshot(self, blob: memoryview) -> int: ...


class ReplicaQuorum(ReplicaSync):
    """One replica group's membership in the job's quorum (built by the launcher, driven by the
    Trainer: `attach`, then per step `start_step`, `reduce`, `should_commit`).

    `index`/`count`: this replica's slot and the job's replica count (its data shard, as a
    data-parallel rank of a DP=`count` run); `emit(kind, **fields)` sends an event; `group`:
    the replica's process group when it has several ranks (replica_group.py), whose shard rank
    this rank is (then it reads as data-parallel rank index*S + shard rank of count*S)."""

    def __init__(
        self,
        index: int,
        count: int,
        *,
        lighthouse_addr: str,
        liveness_addr: str | None = None,
        timeout_s: float = 60.0,
        startup_wait_s: float = 120.0,
        peers_finished: Callable[[], bool] | None = None,
        emit: Callable[..., Any] | None = None,
        device: torch.device | None = None,
        heartbeat_timeout_ms: int = 500,
        group: ReplicaMembership | None = None,
        on_lighthouse_lost: Callable[[str], None] | None = None,
        last_progress: Callable[[], int | None] | None = None,
        redistribute: bool = False,
        expect: int | None = None,
    ):
        super().__init__()
        self.index, self.count = index, count
        # How many replicas this one waits for before its first step (default: every slot). A
        # replica group started into a running job that was resized live runs beside fewer than
        # `count` (workers/replica_fits.py): it waits for those, not for slots nobody fills.
        self.expect = max(1, min(count, expect or count))
        # lost_replica_share: redistribute (the others take a missing replica's microbatches).
        self.redistribute = redistribute
        self._slots: list[int] | None = None  # this step's training replicas, when some are missing
        self.group = group
        self.shard_size = group.size if group is not None else 1
        self.shard_rank = group.shard_rank if group is not None else 0
        self.timeout_s, self.startup_wait_s = timeout_s, startup_wait_s
        # Whether the job's last step is done (a replacement that started late must not wait for
        # peers that have finished and left): asked only until this replica's first commit.
        self.peers_finished = peers_finished  # (`job_done`, ReplicaSync's, says when it was so)
        # The job's Lighthouse (host:port) and its liveness relay (engine/fault_tolerance/lighthouse.py;
        # None: a bare torchft Lighthouse, where a death is noticed by the heartbeat timeout
        # alone), given by the caller: the engine reads no environment for them.
        self.lighthouse_addr = lighthouse_addr
        self.liveness_addr = liveness_addr or None
        self._link: LivenessLink | None = None
        self.on_lighthouse_lost = on_lighthouse_lost  # (message): the relay's link saw it close
        # The job's newest step reported before this replica started (workers/registry.py), for
        # the steps a resume from the persistent checkpoint lost; None: unknown.
        self.last_progress = last_progress
        self.emit = emit  # default: the Trainer's event record (attach)
        self.device = device or torch.device("cpu")
        # Five heartbeats per timeout (the Lighthouse's, resilience.replica_heartbeat_timeout_ms):
        # one late heartbeat does not drop a live replica.
        self.heartbeat_interval = timedelta(milliseconds=max(4, heartbeat_timeout_ms // 5))
        self.manager: Any = None
        self.trainer: ReplicaState | None = None
        self.replicas = count  # participants of the current step's quorum
        self.joined_at: float | None = None
        self._lost_at: float | None = None  # when the survivors first stepped with fewer replicas
        self._step_times: list[float] = []
        self._step_started = 0.0
        self._last_commit_at: float | None = None
        self.want_stop = False
        self._stop_seen = False
        # A release (leave_agreed): asked, then carried by a step's reduction, then out once that
        # step is committed (`_leaves`); the others count the replicas released in it
        # (`_released`), so the next quorum's smaller count is a release, not a loss.
        self._want_leave = False
        self._leaves = False
        self._released = 0
        self._served_heal = False  # a peer healed from this replica's state in this quorum
        self._served: Any = None  # the snapshot it healed from
        self._heal_buffer: bytearray | None = None  # what the last snapshot served was captured into
        self._healed = False  # this step's quorum healed this replica
        self._ever_healed = False  # it took a peer's state before its first commit
        self._start_iteration = 0  # the iteration its own build resumed (0: a fresh start)
        # `sits_out` / `waits_for_peers` (ReplicaSync's, set by `start_step`): this step it heals,
        # or it is alone before the job's first step and its results are not kept.

    # ------------------------------------------------------------------ setup
    def attach(self, trainer: ReplicaState) -> None:
        """Join the quorum with `trainer`'s state as what a peer heals from."""
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport

        from engine.fault_tolerance.quorum_gloo import QuorumGloo

        self.trainer = trainer
        self._start_iteration = trainer.iteration
        if self.emit is None:
            self.emit = trainer.events.append
        timeout = timedelta(seconds=self.timeout_s)
        if self.device.type == "cuda":
            from torchft import ProcessGroupNCCL

            pg = ProcessGroupNCCL(timeout=timeout)
        else:
            pg = QuorumGloo(timeout=timeout)  # a short rendezvous: a peer dying in it costs 5x that
        transport = PGTransport(pg, timeout=timeout, device=self.device)
        self.manager = Manager(
            pg=pg,
            min_replica_size=1,
            load_state_dict=self._load_state,
            state_dict=self._state,
            # Replicas start from the same seed or the same checkpoint: no sync at step 0.
            init_sync=False,
            # The quorum and a heal run beside the forward and backward: the survivors do not wait
            # for a joiner's transfer on top of their step (the joiner sits that step out).
            use_async_quorum=True,
            world_size=self.shard_size,
            rank=self.shard_rank,
            replica_id=self.group.replica_id if self.group is not None else f"replica{self.index}-{os.getpid()}",
            store_addr=self.group.store_addr if self.group is not None else None,
            store_port=self.group.store_port if self.group is not None else None,
            lighthouse_addr=self.lighthouse_addr,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            checkpoint_transport=transport,
            heartbeat_interval=self.heartbeat_interval,
        )
        # torchft's step is the quorum's measure of who is behind (a replica whose step is below
        # the quorum's highest heals): it must follow the Trainer's iteration, not the commits
        # since this process started. Two replicas that started from different checkpoints (one
        # built before a newer one was committed, when the last replica died too) would
        # otherwise both count from 0 and train on different states side by side. One below the
        # iteration: a replacement that resumed the checkpoint of the survivors' very step still
        # heals from them (a live peer's state, and its digest, rather than trusting that the
        # checkpoint equals it), while replicas that all start from one checkpoint stay equal.
        self.manager.load_state_dict({"step": max(0, trainer.iteration - 1), "batches_committed": 0})
        if self.liveness_addr and self.shard_rank == 0:  # the rank whose ManagerServer heartbeats
            from torchft.manager import REPLICA_ID_KEY

            replica_id = self.manager._store.get(REPLICA_ID_KEY).decode()  # with torchft's uuid
            self._link = LivenessLink(
                self.liveness_addr,
                replica_id,
                self.heartbeat_interval.total_seconds(),
                on_lost=self._lighthouse_lost,
            )
        if self.group is not None:  # a peer of this replica died: leave the quorum at once
            self.group.on_lost.append(self.shutdown)
        self.joined_at = time.time()
        # Until this replica's first committed step, a step needs every replica (a job's start
        # waits for all of them, not for the first one built); after that, or once
        # `startup_wait_s` passed (the others finished or are gone), one is enough.
        # Private: torchft 0.2.0 has no public setter for the per-step minimum.
        self.manager._min_replica_size = self.expect
        self._first_commit = False

    def _state(self) -> dict[str, Any]:
        # torchft asks for it only to send it to a replica that heals from this one. The tensor
        # is a view of the captured block (no copy: a copy per heal is a pass over the whole
        # state with the survivors waiting), in a buffer kept for the next heal.
        self._served_heal = True
        snap = self._served = self.trainer.capture_snapshot(self._heal_buffer)
        self._heal_buffer = snap.block.obj
        return {"snapshot": torch.frombuffer(snap.seal(), dtype=torch.uint8)}

    def _load_state(self, state: dict[str, Any]) -> None:
        # A view of the received tensor, parsed and checked (checksum, rank, layout) in place.
        self.trainer.restore_snapshot(memoryview(state["snapshot"].cpu().numpy()))
        self._healed = self._ever_healed = True

    # ------------------------------------------------------------------ per step
    def start_step(self, train_iters: int) -> bool:
        """Ask for this step's quorum; torchft answers it, and sends or receives a heal, on its
        own thread while the forward and backward run (`reduce` waits for it). False when this
        replica joined after its peers finished the job (`job_done`), or its state is already at
        `train_iters`: nothing to train."""
        if not self._first_commit and self.peers_finished is not None and self._agreed(self.peers_finished()):
            self.job_done = True
            return False
        self._step_started = time.perf_counter()
        self._healed = False
        self.manager.start_quorum()
        # Until it has stepped with the others (a replacement, or a job's start) a replica waits
        # for its quorum here: when it heals in this step, a forward and backward on its old
        # state would be thrown away, and would hold the others up at the reduction.
        self.sits_out = self.waits_for_peers = False
        if not self._first_commit:
            self.manager.wait_quorum()
            waited = self._agreed(time.time() - self.joined_at > self.startup_wait_s)
            self.manager._min_replica_size = 1 if waited or self._members() >= self.expect else self.expect
            # A replica alone in its quorum that must wait for the others (a job's start: the
            # first built waits for the rest) cannot commit this step (`should_commit`), and has
            # nobody to reduce with: it sits the step out rather than train it. Training it
            # took CPU from its peers' start on a shared node, and its results, validated alone,
            # let the rerun state machine decide alone (a re-run, or an exit 16 writing the
            # job's checkpoint before its peers had started: seen). Only when every rank of the
            # replica is alone (a replica of several ranks has one quorum per shard rank): with a
            # peer in any of them its zeros would count in that peer's reduction, and the peer
            # may commit (its own wait may have run out). Alone and not waited, each rank's
            # minimum is every replica, so its vote is no.
            alone = self._members() == 1 and not waited and self.expect > 1
            self.waits_for_peers = not self._agreed(not alone)
            self.sits_out = bool(self.manager._healing) or self.waits_for_peers
            if self.waits_for_peers:
                time.sleep(PEER_WAIT_POLL_S)
        self._slots = self._training_slots() if self.redistribute else None
        # A heal may have brought the state of a peer that has trained its last step.
        return self.trainer.iteration < train_iters

    def _training_slots(self) -> list[int] | None:
        """The replicas (slots) that train this step, when the quorum lacks some (dead, or healing
        in it); None when every replica trains, or when the agreement failed (a peer died: the
        step is not committed and is taken again). Waits for the quorum (the plan is needed
        before the forward), then one small SUM over the managed group, in which every member
        takes part (the condition, the quorum's participant count, is the same on all) and a
        healing member gives zeros (torchft's)."""
        from torch.distributed import ReduceOp

        self.manager.wait_quorum()
        n = self.manager.num_participants()
        if n >= self.count:
            return None
        mine = torch.zeros(self.count, device=self.device)
        mine[self.index] = 1.0
        self.manager.allreduce(mine, reduce_op=ReduceOp.SUM).wait()
        slots = [i for i, v in enumerate(mine.tolist()) if v > 0.5]
        if self.manager.errored() is not None or len(slots) != n or not self.manager.is_participating():
            return None
        return slots

    def step_shares(self, num_microbatches: int, dp_size: int, dp_rank: int) -> StepShares:
        """Under `redistribute`, in a step that lacks replicas: the missing shares' microbatches
        (each missing replica's in order) dealt in turn to the training replicas, in slot order,
        so they agree without another word; this rank reads its part of a missing replica m's
        share as its data-parallel rank of that replica (m * dp_size + dp_rank, as `data_rank`).
        Every rank weights its gradients by trained/count: the quorum averages over the training
        replicas, the uninterrupted run over all."""
        slots = self._slots
        if not slots or self.index not in slots:
            return StepShares()
        me, k = slots.index(self.index), len(slots)
        work = [(m, j) for m in range(self.count) if m not in slots for j in range(num_microbatches)]
        mine: dict[int, list[int]] = {}
        for i, (m, j) in enumerate(work):
            if i % k == me:
                mine.setdefault(m, []).append(j)
        extra = tuple((m * dp_size + dp_rank, tuple(picked)) for m, picked in mine.items())
        return StepShares(extra=extra, weight=k / self.count)

    def _quorum_answered(self) -> None:
        """The quorum of this step is known: its replicas, and the events its change calls for
        (the healed replica's own comes from `_heal`, once its state is loaded)."""
        self.manager.wait_quorum()
        # Replicas that train this step: a replica healing in it counts from its next step.
        n = self.manager.num_participants()
        healing = self.manager._healing  # torchft 0.2.0 has no public "healing" flag
        reports = not healing and self.participating_rank == 0 and self.shard_rank == 0
        # Fewer replicas than those released at the last step (which said `replica_left`): lost.
        if reports and n < self.replicas - self._released and self._first_commit:
            self._lost_at = time.time()
            # The stall: from the last committed step to now (the failed step, the quorum without
            # the dead replica, this step's forward and backward) less a normal step.
            median = self.median_step_s() or 0.0
            stall = time.perf_counter() - self._last_commit_at - median if self._last_commit_at else None
            self.emit(
                EVENT_REPLICA_LOST,
                replica=self.index,
                iteration=self.trainer.iteration,
                replicas=n,
                stall_s=round(stall, 3) if stall is not None else None,
            )
        elif not healing and (self._served_heal or (reports and n > self.replicas and self._lost_at is not None)):
            # The survivors' side, from the one that served the heal: its digest is the one the
            # healed replica must equal. rejoin_s is None when the replacement came back before
            # the survivors had dropped the dead replica (a warm process can: no step alone).
            self.emit(
                EVENT_REPLICA_REJOINED,
                replica=self.index,
                iteration=self.trainer.iteration,
                replicas=n,
                rejoin_s=round(time.time() - self._lost_at, 3) if self._lost_at is not None else None,
                **self._shard_fields(),
                state_digest=self.state_digest(self._served),
            )
            self._lost_at = None
        self._served_heal, self._served = False, None
        self._released = 0
        self.replicas = n

    def _heal(self) -> None:
        """Load the state received from a peer, after this step's reduction (to which this
        replica gave zeros) and before its optimizer step: the step then applies the quorum's
        gradients to the peer's state, as the peer does. The forward and backward this replica
        ran on its old state are thrown away."""
        self.manager._apply_pending_state_dict()  # calls _load_state; as torchft's own sync path
        self.manager._healing = False
        if not self._healed:  # the transfer failed: the step is not committed, the next one heals
            return
        self.emit(
            EVENT_REPLICA_REJOINED,
            replica=self.index,
            iteration=self.trainer.iteration,
            replicas=self.replicas,
            heal_s=round(time.perf_counter() - self._step_started, 3),
            **self._shard_fields(),
            state_digest=self.state_digest(),
            joined_s=round(time.time() - self.joined_at, 3) if self.joined_at else None,
        )

    def _shard_fields(self) -> dict[str, int]:
        """A replica of several ranks: each rank's event says which shard it is (its digest is
        of its own shard's state, equal to the same shard rank's of its peer replica)."""
        return {"shard_rank": self.shard_rank} if self.shard_size > 1 else {}

    def _agreed(self, flag: bool) -> bool:
        """`flag` on any rank of this replica (its own group, one tiny all-reduce)."""
        if self.shard_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item() > 0)

    def state_digest(self, snap: Any = None) -> str:
        """A digest of every tensor this replica would hand a peer (weights, optimizer state, RNG):
        the healed replica's and its peer's must be equal at the step it rejoins. `snap`: the
        snapshot this replica just sent a healing peer (the same state, not captured twice)
        while both wait for each other. XXH3-128: it runs at memory speed, a cryptographic hash
        would add seconds per gigabyte of state to every heal."""
        import xxhash

        snap = snap if snap is not None else self.trainer.capture_snapshot()
        h = xxhash.xxh3_128(str(snap.iteration).encode())
        h.update(snap.payload)
        return h.hexdigest()

    @property
    def participating_rank(self) -> int | None:
        return self.manager.participating_rank() if self.manager is not None else None

    # ------------------------------------------------------------------ ReplicaSync's answers
    def data_rank(self, dp_size: int, dp_rank: int) -> tuple[int, int]:
        """A replica's rank reads as data-parallel rank index * S + its rank of count * S (S: the
        replica's ranks, its DP group)."""
        return self.count * dp_size, self.index * dp_size + dp_rank

    @property
    def across_replicas(self):
        return self.any_over_replicas

    @property
    def writes_checkpoint(self) -> bool:
        """One replica writes the job's persistent checkpoints, the first of the step's quorum:
        each holds the whole state over its ranks, and two writing one checkpoint would race."""
        return self.participating_rank == 0

    def step_share(self, global_batch_size: int, dp_size: int) -> tuple[int, int, int]:
        """A step may average over fewer replicas: the missing replicas' samples are skipped
        (`skip`) or taken by the others (`redistribute`: the whole global batch is trained); the
        devices are every replica's ranks in the quorum."""
        shares = self.replicas if self._slots is None else self.count
        return self.replicas, global_batch_size * shares // self.count, self.replicas

    @torch.no_grad()
    def reduce(self, ddp_chunks: list, loss: torch.Tensor) -> torch.Tensor:
        """Average the grads (in place) and the loss over the quorum's replicas: what this rank
        holds of the reduced gradient (the whole buffers on a one-rank replica; this rank's
        shard ranges in a replica of several: replica_group.py's `shard_grad_views`), reduced
        with the same shard rank of every other replica."""
        grads = shard_grad_views(ddp_chunks)
        self._quorum_answered()
        flat = None
        if len(grads) > 1 and self.shard_size > 1:  # one collective for the shard's ranges
            flat = torch.cat([g.reshape(-1) for g in grads])
            works = [self.manager.allreduce(flat)]
        else:
            works = [self.manager.allreduce(buf) for buf in grads]
        # The loss, the stop flag and the leave flag in one: the mean of a flag over the replicas is
        # > 0 when any asked, and the leave flag's times the participants is how many leave. Built
        # on the device: no host sync for the loss (the flags below are the step's one).
        pair = torch.zeros(3, device=grads[0].device)
        pair[0] = loss.detach().float()
        if self.want_stop:
            pair[1] = 1.0
        if self._want_leave:
            pair[2] = 1.0
        works.append(self.manager.allreduce(pair))
        for w in works:
            w.wait()
        if flat is not None:
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        # Each shard rank heard its own peers' flags: the replica stops as one.
        stop, leaving = pair[1:].tolist()  # one read of both flags
        self._stop_seen = self._stop_seen or self._agreed(stop > 0)
        # A failed reduction's values are not to be read (torchft): no release counted from it.
        ok = self.manager.errored() is None and math.isfinite(leaving)
        self._released = round(leaving * max(1, self.manager.num_participants())) if ok else 0
        if self.manager._healing:
            self._heal()
        return pair[0].to(loss.dtype).reshape(())

    @torch.no_grad()
    def any_over_replicas(self, flags: torch.Tensor) -> torch.Tensor:
        """The rerun state machine's flags (int, each already OR-ed over this replica's ranks)
        OR-ed over the quorum's replicas: a re-run is another reduction over the replicas, so
        every replica must re-run the step, or none (one that re-ran alone would wait for peers
        that had moved on: measured, a 60 s quorum timeout and the replica lost). A replica
        healing in this step gives zeros (torchft) and takes the others' decision. If the
        reduction fails (a replica died during it) the flags stay this replica's own and the step
        is not committed (`should_commit`), so the step, re-run or not, is taken again."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(flags, reduce_op=ReduceOp.SUM).wait()
        return flags

    @property
    def left(self) -> bool:
        """This replica was released and left the quorum (leave_agreed): the job goes on without it."""
        return self._leaves

    def leave_agreed(self, mine: bool) -> bool:
        """Released (a live shrink). Asked (agreed over this replica's ranks), the release travels
        with the next step's reduction, as a stop does, so the others know it is one; once that
        step is committed the replica leaves the quorum at the step boundary. No step of the
        others fails (a replica that dies instead costs them the step it was in): its liveness
        link closes and the next quorum is agreed without it within the relay's ~0.1 s. Its
        first rank says so (`replica_left`), and the others send no `replica_lost` for it."""
        if self._leaves:
            if self.shard_rank == 0:
                self.emit(EVENT_REPLICA_LEFT, replica=self.index, iteration=self.trainer.iteration, replicas=self.replicas)
            self.shutdown()
            return True
        if not self._want_leave and self._agreed(mine):
            self._want_leave = True
        return False

    def stop_agreed(self, mine: bool) -> bool:
        """The scheduler's stop (heard by one replica) travels with the next step's reduction, so
        every replica of the quorum stops at the same step boundary, one step after it was asked."""
        self.want_stop = self.want_stop or mine
        return self._stop_seen

    def should_commit(self) -> bool:
        """Every replica of the quorum reduced successfully: step the optimizer."""
        # A job's first step needs every replica in the quorum, training or healing (torchft
        # counts only those that train; `start_step` set the minimum, with the startup wait
        # agreed over the replica's ranks).
        ok = self.manager.should_commit()  # agreed by torchft within the replica
        if ok and not self._first_commit:
            self._first_commit = True
            self.manager._min_replica_size = 1
            self._report_checkpoint_resume()
        if ok:
            # Asked before this step (leave_agreed runs at the step boundary only), so its
            # reduction carried the release: the others heard it.
            self._leaves = self._want_leave
            self._last_commit_at = time.perf_counter()
            self._step_times.append(self._last_commit_at - self._step_started)
        return ok

    def _report_checkpoint_resume(self) -> None:
        """At the first commit: if no replica of the quorum took a live peer's state, they all
        resumed the persistent checkpoint (every replica had died, or the Lighthouse had, or the
        job was launched again): the quorum's first replica says so as restart_group's rank 0
        does (`recovered`, with the steps lost). torchft counts a replica's step one below its
        iteration (attach), so a replacement that resumed the survivors' very step still heals:
        a replacement is never taken for a resume."""
        if self._ever_healed or self._start_iteration == 0 or self.participating_rank != 0 or self.shard_rank:
            return
        reached = self.last_progress() if self.last_progress is not None else None
        self.emit(
            EVENT_RECOVERED,
            **{
                RECOVERED_FROM: "persistent",
                STEPS_LOST: max(0, reached - self._start_iteration) if reached is not None else None,
            },
            iteration=self._start_iteration,
            reached=reached,
            replica=self.index,
            replicas=self.replicas,
        )

    def _members(self) -> int:
        """Replicas in this step's quorum, healing ones included (its process group's size)."""
        try:
            return self.manager._pg.size()
        except (AssertionError, RuntimeError):  # not configured: the quorum failed
            return 0

    def median_step_s(self) -> float | None:
        return statistics.median(self._step_times[-50:]) if self._step_times else None

    def _lighthouse_lost(self) -> None:
        """The job's Lighthouse is gone (its actor's process died): no quorum can be agreed any
        more, and torchft's Manager keeps waiting for one until the quorum timeout (up to 60 s
        with every replica stalled). `on_lighthouse_lost` fails this process now instead (the
        rank's watchdog: its event, its kill); Ray then starts the replicas again against a new
        Lighthouse (workers/trainer.py's backend)."""
        if self.on_lighthouse_lost is not None:
            self.on_lighthouse_lost(
                f"replica {self.index}: the job's Lighthouse ({self.lighthouse_addr}) closed its "
                "liveness link: its process is gone, so no quorum can be agreed"
            )

    def shutdown(self) -> None:
        """Leave the quorum (the loop's end, or a watcher's: replica_group.py)."""
        manager, self.manager = self.manager, None
        link, self._link = self._link, None
        if link is not None:
            link.close()
        if manager is not None:
            manager.shutdown(wait=False)
