"""A replica of several ranks (HSDP's shard group) as one fault domain: its own process group,
formed afresh each time one of its ranks is replaced.

With `resilience.on_rank_failure: replace_replica` and `parallel.data_parallel_shard_size` S > 1,
replica r of the job is ranks r*S .. r*S+S-1 (shard rank = rank % S). The launcher replaces
single dead processes (Ray 2.60 replaces replica groups of one worker), so the replica's S ranks
must find each other again every time one of them is new. They do it here:

1. **Rendezvous by rounds** (`ReplicaRounds`, hosted by one process: the job registry actor on
   Ray, a multiprocessing manager in tests). Every fresh process joins its replica exactly once,
   with its shard rank (shard rank 0 brings the address of the TCPStore it hosts). A shard rank
   already present in the replica's current round means that round lost a member: the join
   starts the next round. A round is complete when all S shard ranks joined it; the members of
   a round that was superseded are stale and exit (their replacements join the new round).
2. **The replica's process group** replaces the launcher's default group (Ray's is one rank per
   worker): `init_process_group` over the round's store, shard rank `rank % S`, world S. The
   engine then runs a normal S-rank job on it (the replica's DP=S sharding,
   workers/replicas.py `replica_job`), and torchft's Manager of each rank uses the same store
   (its group-rank-0 ManagerServer publishes its address there; engine/fault_tolerance/replica_quorum.py).
3. **No silent hang when a peer dies.** A collective of the replica's group fails fast on a
   SIGKILLed peer (gloo: "Connection closed by peer"), but a rank can also wait where no
   collective of this group runs: in torchft's quorum or should_commit (its ManagerServer waits
   for every group rank), or at the rendezvous. So each rank watches its peers from the start:
   a posted receive from every peer on a gloo group of its own fails the moment that peer's
   process dies, and a poll of the rendezvous notices a newer round of its own replica (a node
   lost without a TCP reset). Then the rank leaves the quorum at once (`on_lost` hooks: its
   torchft Manager stops, so the other replicas stop waiting for this one), waits until the
   dead peer's replacement has joined the next round (at most `replace_wait_s`) and exits
   (`exit_process`), so the launcher replaces it as well and the new round heals from a live
   replica. A rank whose main thread failed meanwhile (a collective with the dead peer) holds
   there (`hold_if_lost`) instead of failing at once.

   Why wait for the replacement before exiting: Ray 2.60's controller replaces failed replica
   groups one by one, and while replacing the first it asks every other group that has not been
   replaced yet to clear its results, which fails on a second dead one and ends the attempt
   (worker_group.py `_replace_replica_group_impl`: `ray.get(clear_tasks)`). Two ranks of a
   replica dying within one health-check poll (a lost node) still end the attempt: the job
   then restarts the whole group (`restart_group`'s path) from the newest checkpoint.
4. A rank that finished cleanly says goodbye on the watchers' group first (`close`), so its
   peers' watchers end without a failure.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: `ReplicaRounds` is hosted by the job registry actor,
# which has no other use for it.

# The round a rank belongs to is checked this often (the rendezvous poll; a dead peer's socket
# is noticed at once, without it).
POLL_S = 0.25
_BYE_TAG = 31


class ReplicaRounds:
    """The rendezvous state of every replica of one job (a plain object: its host serialises
    the calls). `join` and `round` are all a rank uses."""

    def __init__(self) -> None:
        self._rounds: dict[int, list[dict[str, Any]]] = {}  # replica -> rounds, newest last

    def join(self, replica: int, shard_rank: int, size: int, address: tuple[str, int] | None) -> int:
        """Enter the replica's current round, or start the next one when this shard rank is in
        it already (its previous process is gone). Returns the round's number."""
        rounds = self._rounds.setdefault(replica, [])
        if not rounds or shard_rank in rounds[-1]["members"] or len(rounds[-1]["members"]) >= size:
            rounds.append({"members": {}, "size": size})
        rounds[-1]["members"][shard_rank] = address
        return len(rounds) - 1

    def round(self, replica: int, number: int) -> dict[str, Any]:
        """A round as its members see it: `complete` (all shard ranks joined), `superseded` (a
        newer round of the replica exists: this one lost a member) and shard rank 0's store."""
        rounds = self._rounds.get(replica, [])
        if number >= len(rounds):
            return {"complete": False, "superseded": False, "store": None}
        r = rounds[number]
        return {
            "complete": len(r["members"]) == r["size"],
            "superseded": number < len(rounds) - 1,
            "store": r["members"].get(0),
        }


class RoundsClient(Protocol):
    """How a rank reaches the `ReplicaRounds` of its job (a Ray actor handle's methods called
    synchronously, a manager proxy, the object itself)."""

    def join(self, replica: int, shard_rank: int, size: int, address: tuple[str, int] | None) -> int: ...

    def round(self, replica: int, number: int) -> dict[str, Any]: ...


class ReplicaSuperseded(RuntimeError):
    """This rank's round lost a member before it was complete: the rank is stale."""


@dataclass
class ReplicaMembership:
    """This rank's place in its replica (the group the engine runs on), and its watchers."""

    replica: int
    shard_rank: int
    size: int
    round: int
    store_addr: str
    store_port: int
    store: Any = field(repr=False, default=None)
    liveness: Any = field(repr=False, default=None)
    closing: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)  # a peer of this round is gone
    # Called (once, from a watcher) when the round lost a member: what must stop at once (this
    # rank's torchft Manager: the other replicas must not wait for this one).
    on_lost: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _threads: list[threading.Thread] = field(default_factory=list, repr=False)
    _lost_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def replica_id(self) -> str:
        """torchft's replica id of this replica in this round (the same on its ranks)."""
        return f"replica{self.replica}-{self.round}"

    def hold_if_lost(self, grace_s: float = 2.0) -> None:
        """The main thread failed: when a peer of this round is gone (or is noticed gone within
        `grace_s`), block: the watcher ends the process once the peer was replaced (see the
        module docstring for why not at once). Returns when no peer is lost (a failure of its own)."""
        if self.lost.wait(grace_s):
            while True:
                time.sleep(60)

    def close(self) -> None:
        """A clean end: stop watching, and tell every peer (its watcher of this rank ends quietly)."""
        if self.closing.is_set():
            return
        self.closing.set()
        if self.liveness is None:
            return
        import torch

        bye = torch.ones(1)
        works = []
        for peer in range(self.size):
            if peer != self.shard_rank:
                try:
                    works.append(self.liveness.send([bye], peer, _BYE_TAG))
                except Exception:  # noqa: BLE001 - the peer is gone: nothing to tell
                    pass
        for w in works:
            try:
                w.wait(timedelta(seconds=2))
            except Exception:  # noqa: BLE001
                pass


def exit_process(message: str, before: Callable[[], None] | None = None) -> None:
    """The end of a rank whose replica lost a member: `before` (e.g. its telemetry flushed), then
    exit 75 so that the launcher replaces this rank too."""
    print(f"[elastron] {message}; exiting so that this rank is replaced too", file=sys.stderr, flush=True)
    if before is not None:
        try:
            before()
        except Exception:  # noqa: BLE001 - the exit matters more
            pass
    os._exit(75)


def form_replica_group(
    rounds: RoundsClient,
    replica: int,
    shard_rank: int,
    size: int,
    *,
    backend: str,
    host: str,
    timeout: timedelta,
    setup_timeout_s: float = 600.0,
    replace_wait_s: float = 60.0,
    exit: Callable[[str], None] = exit_process,
) -> ReplicaMembership:
    """Join replica `replica` as `shard_rank` of `size`, wait for its round to be complete and
    make the round's process group the default one (the launcher's default group, if any, is
    destroyed first). When a peer of the round dies or the round is superseded, a watcher runs
    the membership's `on_lost` hooks, waits for the dead peer's replacement (at most
    `replace_wait_s`) and calls `exit(message)`, which must end the process."""
    import torch.distributed as dist

    store = None
    address = None
    if shard_rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        address = (host, store.port)
    number = rounds.join(replica, shard_rank, size, address)
    deadline = time.monotonic() + setup_timeout_s
    while True:
        state = rounds.round(replica, number)
        if state["superseded"]:
            raise ReplicaSuperseded(
                f"replica {replica} round {number} lost a member before it formed (shard rank {shard_rank})"
            )
        if state["complete"]:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"replica {replica}: its {size} ranks did not all join round {number} within {setup_timeout_s:.0f} s"
            )
        time.sleep(0.02)
    store_addr, store_port = state["store"]
    if store is None:
        store = dist.TCPStore(store_addr, store_port, is_master=False, wait_for_workers=False, timeout=timeout)
    membership = ReplicaMembership(replica, shard_rank, size, number, store_addr, store_port, store)
    on_lost = partial(_lose, membership, rounds, replace_wait_s, exit)
    _watch_round(membership, rounds, on_lost)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend, store=dist.PrefixStore("replica-pg", store), rank=shard_rank, world_size=size, timeout=timeout
    )
    # Its own gloo group (whatever the backend): a pending receive from each peer that fails the
    # moment that peer's process is gone.
    # No timeout worth the name: the receive waits for the peer's goodbye for the whole run.
    membership.liveness = dist.new_group(backend="gloo", timeout=timedelta(days=30))
    for peer in range(size):
        if peer != shard_rank:
            _watch_peer(membership, peer, on_lost)
    return membership


def _lose(m: ReplicaMembership, rounds: RoundsClient, wait_s: float, exit: Callable[[str], None], message: str) -> None:
    with m._lost_lock:
        if m.lost.is_set() or m.closing.is_set():
            return
        m.lost.set()
    for hook in m.on_lost:
        try:
            hook()
        except Exception:  # noqa: BLE001 - leaving the quorum failed: the exit below ends it anyway
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if rounds.round(m.replica, m.round)["superseded"]:
                break
        except Exception:  # noqa: BLE001 - the rendezvous' host is busy or gone: keep the bound
            pass
        time.sleep(0.05)
    exit(message)


def _watch_round(m: ReplicaMembership, rounds: RoundsClient, on_lost: Callable[[str], None]) -> None:
    def run() -> None:
        while not m.closing.wait(POLL_S):
            try:
                superseded = rounds.round(m.replica, m.round)["superseded"]
            except Exception:  # noqa: BLE001 - the rendezvous' host is busy or gone: the peers' sockets still tell
                continue
            if superseded and not m.closing.is_set():
                on_lost(f"replica {m.replica}: round {m.round} was superseded (one of its ranks was replaced)")
                return

    t = threading.Thread(target=run, name=f"replica{m.replica}-round", daemon=True)
    t.start()
    m._threads.append(t)


def _watch_peer(m: ReplicaMembership, peer: int, on_lost: Callable[[str], None]) -> None:
    import torch

    buf = torch.zeros(1)
    work = m.liveness.recv([buf], peer, _BYE_TAG)

    def run() -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - the peer's process is gone
            if not m.closing.is_set():
                on_lost(f"replica {m.replica}: shard rank {peer} of round {m.round} is gone ({str(e)[:120]})")

    t = threading.Thread(target=run, name=f"replica{m.replica}-peer{peer}", daemon=True)
    t.start()
    m._threads.append(t)


def shard_grad_views(ddp_chunks: list) -> list[torch.Tensor]:
    """What this rank holds of the step's reduced gradient, to be averaged with the same shard
    rank of the other replicas: its shard range of every bucket (ZeRO-1 keeps whole buffers
    whose other ranges hold unreduced local sums), the shard buffer itself (ZeRO-2/3 keep only
    the shard), or the whole buffer (no sharding, or a one-rank replica)."""
    views: list[torch.Tensor] = []
    for ddp in ddp_chunks:
        if ddp.sdp == 1 or not getattr(ddp.grad_sync, "scatter", False):
            views.append(ddp.grad_buffer)  # whole, or (ZeRO-2/3) nothing but this rank's shards
            continue
        for bucket in ddp.buckets:
            lo, hi = bucket.shard_range()
            views.append(bucket.grad[lo:hi])
    return views
