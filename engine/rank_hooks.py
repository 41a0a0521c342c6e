"""The seam between a launcher and the engine's per-rank loop (`engine.train_loop.train_rank`):
who this rank is (`RankIdentity`) and what the launcher wants to hear (`RankHooks`).

A launcher (the local `elastron train`, a Ray worker) hands both to `train_rank`, which passes
them to the Trainer: the identity to its event record (the rerun state machine's "same
hardware?" comparison reads it there) and `on_event` to be called with each event, in-process.
Nothing travels through the environment or through a file the same process writes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.jobspec import contract


class RankTrainer(Protocol):
    """The rank's Trainer as the hooks hand it to a launcher: what `on_trainer` and
    `on_snapshot_due` are for. The Trainer (engine/training.py) is built a floor above this seam,
    from the identity and hooks defined here, so the seam names only what it promises: progress
    for a watchdog (`iteration`, `phase`, which a launcher may set while it recovers), the
    persistent checkpointer for a shutdown hook (None without `checkpoint.path`), and the
    in-memory snapshot a launcher takes and a recovery restores (`capture_snapshot`,
    `restore_snapshot`; engine/checkpointing/snapshot_manager.py)."""

    iteration: int
    phase: str
    checkpointer: Any

    def capture_snapshot(self, buffer: bytearray | None = None) -> Any: ...

    def restore_snapshot(self, blob: Any) -> int: ...


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
    - `should_stop()`: asked on every rank before each step (give it to all ranks or none):
      when any rank says yes, every rank saves a persistent checkpoint at the current step and
      `train_rank` returns early (a scheduler's preemption: at most the step in flight is lost).
    - `should_leave()`: with replicas as fault domains, asked on every rank of a replica before
      each step (give it to all of them or none): when any says yes, this replica leaves the
      job's quorum at that step boundary and `train_rank` returns without a checkpoint, while
      the others go on (a live shrink; they take its share under `lost_replica_share:
      redistribute`). A job that is one replica never leaves.
    - `quorum`: not a hook; see its comment.
    """

    on_trainer: Callable[[RankTrainer], None] | None = None
    on_record: Callable[[dict], None] | None = None
    on_snapshot_due: Callable[[RankTrainer], None] | None = None
    on_event: Callable[[dict], None] | None = None
    should_stop: Callable[[], bool] | None = None
    should_leave: Callable[[], bool] | None = None
    # Not a hook: with resilience.on_rank_failure replace_replica, this replica group's
    # membership in the job's quorum (engine/fault_tolerance/replica_quorum.py), built by the launcher.
    quorum: Any = None
