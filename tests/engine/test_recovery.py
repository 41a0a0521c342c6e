"""The recovery protocol (engine/checkpointing/recovery.py) over an in-process store, on two real
ranks (gloo, DP=2): the ranks agree on the newest iteration every rank has, a refused or
unreachable copy sends a rank to the next place, a copy no rank may use sends the group to an
older iteration, and with nothing newer the persistent checkpoint stands. workers/snapshots.py's
Ray store is exercised on a cluster by tests/workers/test_ray_recovery.py."""

from __future__ import annotations

import torch.distributed as dist

from engine import parallel_state as ps
from engine.checkpointing.checkpointer import layout_signature
from engine.checkpointing.recovery import recover
from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.training import Trainer
from tests.engine.parallel_harness import job

HERE = "here"


class DictStore:
    """A SnapshotStore in this process: (place, rank, iteration) -> (world size, layout, blob);
    a place listed in `unreachable` raises on get, as a holder on a lost node does."""

    def __init__(self, unreachable: tuple[str, ...] = ()):
        self.copies: dict[tuple[str, int, int], tuple[int, str, bytes]] = {}
        self.unreachable = set(unreachable)
        self.forgotten_after: list[int] = []

    def put(
        self, rank: int, iteration: int, world_size: int, layout: str, blob: bytes, where: str = HERE
    ) -> None:
        self.copies[(where, rank, iteration)] = (world_size, layout, blob)

    def available(self, rank: int, world_size: int, layout: str) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for (where, r, it), (w, lay, _) in self.copies.items():
            if (r, w, lay) == (rank, world_size, layout):
                out.setdefault(it, []).append(where)
        return out

    def get(self, rank: int, iteration: int, where: str) -> bytes | None:
        if where in self.unreachable:
            raise ConnectionError(f"{where} is gone")
        entry = self.copies.get((where, rank, iteration))
        return None if entry is None else entry[2]

    def is_local(self, where: str) -> bool:
        return where == HERE

    def forget_after(self, iteration: int) -> None:
        self.forgotten_after.append(iteration)


def _corrupt(blob: bytes) -> bytes:
    bad = bytearray(blob)
    bad[-3] ^= 0x10
    return bytes(bad)


def _cases() -> dict:
    """Rank function: snapshots of iterations 1-3, then a fresh Trainer per case recovers from a
    store filled as the case says."""
    spec = JobSpec.model_validate(job(2, training={"train_iters": 6}))
    first = Trainer(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = layout_signature(spec.parallel)
    blobs = {}
    for _ in range(3):
        first.train_step()
        blobs[first.iteration] = first.capture_snapshot().to_bytes()
    after_3 = first.train_step().loss
    ps.destroy_model_parallel()

    def fill(store: DictStore, plan: dict[int, list[tuple[str, bool]]]) -> DictStore:
        """plan: iteration -> [(place, good)] for this rank."""
        for it, places in plan.items():
            for where, good in places:
                store.put(rank, it, world, layout, blobs[it] if good else _corrupt(blobs[it]), where)
        return store

    good = [(HERE, True)]
    plans = {
        # rank 1 never pushed iteration 3: the newest every rank has is 2
        "agree": {1: good, 2: good, 3: good} if rank == 0 else {1: good, 2: good},
        # rank 0's own copy of 3 is corrupted and one replica is unreachable; another replica is good
        "replica": {2: good, 3: [(HERE, False), ("lost-node", True), ("other-node", True)]}
        if rank == 0
        else {2: good, 3: good},
        # rank 1's only copy of 3 is refused: every rank goes back to 2
        "refused": {2: good, 3: good} if rank == 0 else {2: good, 3: [(HERE, False)]},
        "nothing": {},
    }
    out = {}
    for name, plan in plans.items():
        store = fill(DictStore(unreachable=("lost-node",)), plan)
        fresh = Trainer(spec)
        result = recover(fresh, store)
        out[name] = {
            "recovered_from": result["recovered_from"],
            "iteration": result["iteration"],
            "trainer_at": fresh.iteration,
            "forgotten_after": store.forgotten_after,
            "next_loss": fresh.train_step().loss if name == "replica" else None,
        }
        ps.destroy_model_parallel()
    out["after_3"] = after_3
    return out


def test_the_ranks_resume_from_the_newest_snapshot_every_rank_can_use():
    results = spawn(_cases, 2, timeout_s=240)
    for rank, r in enumerate(results):
        assert (r["agree"]["recovered_from"], r["agree"]["iteration"], r["agree"]["trainer_at"]) == (
            "memory",
            2,
            2,
        )
        assert r["agree"]["forgotten_after"] == [2]
        # rank 0 read a replica: the group says so; the restored state trains on exactly
        assert (r["replica"]["recovered_from"], r["replica"]["iteration"]) == ("replica", 3), rank
        assert r["replica"]["next_loss"] == r["after_3"]
        assert (r["refused"]["recovered_from"], r["refused"]["iteration"], r["refused"]["trainer_at"]) == (
            "memory",
            2,
            2,
        )
        assert r["nothing"] == {
            "recovered_from": "persistent",
            "iteration": 0,
            "trainer_at": 0,
            "forgotten_after": [],
            "next_loss": None,
        }
