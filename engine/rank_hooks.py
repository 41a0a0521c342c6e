"""The seam between a launcher and the engine's per-rank loop (`engine.train_loop.train_rank`):
who this rank is (`RankIdentity`) and what the launcher wants to hear (`RankHooks`).

A launcher (the local `elastron train`, a Ray worker) hands both to `train_rank`; nothing
travels through the environment or a file the same process writes. While `train_rank` runs,
its identity and event hook are bound to the process (`bound`), beside parallel_state's rank
grid: one rank per process, and the rerun state machine's event record and its "same hardware?"
comparison read them from any thread (the checkpointer's background save appends events too).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.jobspec import contract

if TYPE_CHECKING:
    from engine.training import Trainer


@dataclass(frozen=True)
class RankIdentity:
    """Who runs this rank. `node_id` is the hardware identity the rerun state machine compares
    to tell "other hardware" (a Ray worker: its Ray node id, plus `/gpuN` on CUDA)."""

    node_id: str
    job_id: str | None = None
    rank: int | None = None
    world_size: int | None = None

    @classmethod
    def local(cls, job_id: str | None = None) -> RankIdentity:
        """A rank started without a cluster manager (`elastron train`): the host name, or the
        operator's `ELASTRON_NODE_ID` (a Kubernetes pod's node name; a drill pretending a move)."""
        return cls(node_id=os.environ.get(contract.ENV_NODE_ID) or socket.gethostname(), job_id=job_id)


@dataclass
class RankHooks:
    """What a launcher hears from the loop; every hook is optional.

    - `on_trainer(trainer)`: every rank, from the training thread, once the Trainer is built and
      resumed, before the first step (a watchdog, a shutdown hook or an in-memory recovery needs
      it; never a half-built one).
    - `on_record(record)`: rank 0's metrics record of every iteration.
    - `on_snapshot_due(trainer)`: every rank, after each iteration `checkpoint.local_interval`
      names: take an in-memory snapshot and keep it where a restarted rank finds it.
    - `on_event(event)`: every event this rank's engine records (rerun state machine,
      checkpointer), as the dict the event record holds, from whichever thread made it.
    """

    on_trainer: Callable[[Trainer], None] | None = None
    on_record: Callable[[dict], None] | None = None
    on_snapshot_due: Callable[[Trainer], None] | None = None
    on_event: Callable[[dict], None] | None = None


@dataclass(frozen=True)
class _Binding:
    identity: RankIdentity
    on_event: Callable[[dict], None] | None


_bound: _Binding | None = None


@contextlib.contextmanager
def bound(identity: RankIdentity, on_event: Callable[[dict], None] | None = None) -> Iterator[None]:
    """Bind this process' rank identity and event hook for the duration (train_rank's)."""
    global _bound
    previous, _bound = _bound, _Binding(identity, on_event)
    try:
        yield
    finally:
        _bound = previous


def node_id() -> str:
    """The bound rank's node id; outside `train_rank` (a unit test, a tool) the local one."""
    return _bound.identity.node_id if _bound is not None else RankIdentity.local().node_id


def emit(event: dict[str, Any]) -> None:
    """Hand an engine event to the bound rank's launcher, if it listens."""
    if _bound is not None and _bound.on_event is not None:
        _bound.on_event(event)
