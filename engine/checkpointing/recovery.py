"""Resume a restarted group from the newest in-memory snapshot every rank still has.

The engine makes and checks the snapshots (memory.py); where they are kept is the launcher's
business (on Ray: per-node holder actors, workers/snapshots.py). The protocol that decides which
one the group resumes from is a collective of the ranks, so it lives here, beside the snapshots,
and reaches the copies only through a `SnapshotStore`.

`recover` (every rank, once the Trainer is built and has resumed from the newest persistent
checkpoint): each rank asks the store which iterations it holds for this rank, world size and
layout, newer than the persistent one; the ranks agree on the newest iteration every rank has
somewhere (an all-gather); each rank fetches its copy (local first, then a replica) and checks
it; only if every rank holds a good one do they all restore (else the next older common
iteration, else the persistent checkpoint stands). `recovered_from` is `memory` when every
rank's copy was local, `replica` when any came from elsewhere, `persistent` otherwise.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch.distributed as dist

from engine.checkpointing.checkpointer import layout_signature
from engine.checkpointing.memory import SnapshotError

log = logging.getLogger(__name__)


class SnapshotStore(Protocol):
    """Where a job's in-memory snapshots are kept, as blobs by rank and iteration. A copy is
    somewhere (`where`: a node, a holder); `is_local(where)` says whether it is this rank's own
    (no transfer from another machine needed)."""

    def put(self, rank: int, iteration: int, world_size: int, layout: str, blob: bytes) -> None:
        """Keep `blob` (a sealed snapshot) for this rank, group shape and iteration."""

    def available(self, rank: int, world_size: int, layout: str) -> dict[int, list[str]]:
        """iteration -> where a copy for this rank and group shape is. A place that does not
        answer is left out, not waited for."""

    def get(self, rank: int, iteration: int, where: str) -> bytes | None:
        """The blob kept there, None when it is gone; raises when the place is unreachable."""

    def is_local(self, where: str) -> bool: ...

    def forget_after(self, iteration: int) -> None:
        """Drop every copy newer than `iteration` (the group resumed from it: those are another
        timeline). Best effort, not waited for."""


def recover(trainer: Any, store: SnapshotStore) -> dict[str, Any]:
    """Resume `trainer` (built, resumed from the persistent checkpoint; it has `iteration`,
    `spec`, `parse_snapshot` and `restore_snapshot`) from the newest snapshot every rank has
    in `store`. A collective: every rank calls it. Returns {"recovered_from", "iteration",
    "agree_s", "restore_s"}."""
    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = layout_signature(trainer.spec.parallel)
    baseline = trainer.iteration
    where = {
        it: sorted(places, key=lambda p: not store.is_local(p))
        for it, places in store.available(rank, world, layout).items()
        if it > baseline and places
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, sorted(where))
    common = sorted(set.intersection(*(set(g) for g in gathered)), reverse=True) if gathered else []
    agree_s = time.perf_counter() - started
    for iteration in common:
        started = time.perf_counter()
        good, source = _fetch(trainer, store, rank, iteration, where[iteration])
        local: list[Any] = [None] * world
        dist.all_gather_object(local, None if good is None else store.is_local(source))
        if any(s is None for s in local):
            continue  # some rank has no good copy of it: an older one, or the persistent checkpoint
        trainer.restore_snapshot(good)
        store.forget_after(iteration)
        return {
            "recovered_from": "memory" if all(local) else "replica",
            "iteration": iteration,
            "agree_s": agree_s,
            "restore_s": time.perf_counter() - started,
        }
    return {"recovered_from": "persistent", "iteration": baseline, "agree_s": agree_s, "restore_s": 0.0}


def _fetch(trainer: Any, store: SnapshotStore, rank: int, iteration: int, places: list[str]):
    """(the parsed snapshot, where it came from) of the first good copy, or (None, None)."""
    for place in places:
        try:
            blob = store.get(rank, iteration, place)
            if blob is None:
                continue
            snap = trainer.parse_snapshot(blob)
            if snap.iteration != iteration:  # listed under one iteration, holding another
                raise SnapshotError(f"holds iteration {snap.iteration}, listed as {iteration}")
            return snap, place
        except SnapshotError as err:
            log.warning("in-memory snapshot of iteration %d on node %s refused: %s", iteration, place, err)
        except Exception as err:  # noqa: BLE001 - the place went away meanwhile
            log.warning(
                "in-memory snapshot of iteration %d on node %s unreachable: %s", iteration, place, err
            )
    return None, None
