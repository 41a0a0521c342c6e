"""One rank's in-memory snapshots: which parts they hold, when one is due, and taking, checking
and restoring them (the byte format is memory.py's).

A snapshot holds the persistent checkpoint's parts less the job record (never restored: the
restarted rank has its spec), with the model and optimizer as this rank holds them instead of in
global, parameter-shaped form (local_shards.py) and the rerun state of this rank only: a
snapshot is restored by the same rank of the same layout, so nothing is assembled or gathered.
The parts are built once: a snapshot may be taken every step, and they cache what they work out
about the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from engine.checkpointing import memory
from engine.checkpointing.local_shards import ModelShards, OptimizerShards
from engine.checkpointing.stateful import RerunMachineState, Stateful


class SnapshotManager:
    """`checkpoint_parts` builds the persistent checkpoint's parts (Trainer.checkpoint_parts);
    `model_chunks`, `ddp_chunks`, `optimizer` and `rerun` are what the rank-local parts read."""

    def __init__(
        self,
        checkpoint_parts: Callable[[], dict[str, Stateful]],
        model_chunks,
        ddp_chunks,
        optimizer,
        rerun,
        *,
        job_name: str,
        layout: str,
        local_interval: int | None,
        train_iters: int,
    ):
        self._checkpoint_parts = checkpoint_parts
        self._owners = (model_chunks, ddp_chunks, optimizer, rerun)
        self.job_name, self.layout = job_name, layout
        self.local_interval, self.train_iters = local_interval, train_iters
        self._parts: dict[str, Stateful] | None = None

    def parts(self) -> dict[str, Stateful]:
        if self._parts is None:
            model_chunks, ddp_chunks, optimizer, rerun = self._owners
            parts = {name: part for name, part in self._checkpoint_parts().items() if name != "job"}
            parts["model"] = ModelShards(model_chunks, ddp_chunks)
            parts["optim"] = OptimizerShards(optimizer, ddp_chunks)
            parts["rerun"] = RerunMachineState(rerun, gather=False)
            self._parts = parts
        return self._parts

    def due(self, iteration: int) -> bool:
        """After iterations that are a multiple of checkpoint.local_interval (not the last)."""
        n = self.local_interval
        return n is not None and iteration % n == 0 and iteration < self.train_iters

    def _identity(self) -> dict:
        return {
            "job": self.job_name,
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "layout": self.layout,
        }

    def capture(self, buffer: bytearray | None = None) -> memory.HostSnapshot:
        """This rank's state copied to host memory: a collective, every rank captures at the same
        iteration. The result's payload lives in `buffer` when it is big enough, so the caller
        must be done with the previous snapshot before reusing it."""
        return memory.capture(self.parts(), buffer=buffer, **self._identity())

    def parse(self, blob: bytes | bytearray | memoryview) -> memory.HostSnapshot:
        """`blob` checked for this rank (checksum; same job, rank, world size, layout):
        SnapshotError if it must not be used."""
        return memory.parse(blob, **self._identity())

    def restore(self, blob: bytes | bytearray | memoryview | memory.HostSnapshot) -> int:
        """Load a snapshot of this rank (bytes, or `parse`'s result), checked before anything is
        loaded; SnapshotError if it must not be used. Returns its iteration."""
        snap = blob if isinstance(blob, memory.HostSnapshot) else self.parse(blob)
        memory.restore(self.parts(), snap)
        return snap.iteration
