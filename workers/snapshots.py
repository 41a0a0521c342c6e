"""In-memory checkpoints on Ray: per-node holders that outlive the ranks, the rank's side, and
the store the engine's recovery protocol reads them through.

The engine makes and takes the bytes (engine/checkpointing/memory.py: one rank's checkpoint
parts, its slice of what its data-parallel replicas share, XXH3-64 checksummed, refused if
corrupted or not this rank's); here is where they live:

- `SnapshotHolder`: one actor per job and node, named `elastron-snap-<job_id>-<node_id>` in
  namespace `elastron`, pinned to its node, 0 CPU. The job registry creates it when a rank asks
  (`JobRegistry.snapshot_holders`), so it survives the rank processes and the end of a `fit()`
  attempt (an actor a rank created would die with the rank) and is owned by the job's driver
  (through its registry): not detached, so when the driver dies, SIGKILL included, Ray kills it
  with the driver's other actors. The driver also kills every holder when the job ends
  (`kill_holders`). It keeps, per rank, the newest `KEEP` snapshots (two: a rank killed while
  pushing step N still has N-1 everywhere). Its node's slot files of the job go with it, however
  it ends (snapshot_files.remove_when_gone: a SIGKILLed process runs no handler).
- `SnapshotPusher` (in each rank): every `checkpoint.local_interval` steps the training thread
  captures the host copy (the only part that blocks the step) straight into the framed block,
  itself a memory-mapped file in the node's RAM-backed directory (snapshot_files.py), and a
  background thread seals it (the checksum) and tells the holder on its own node which file holds
  which iteration; for the `checkpoint.local_replicas` holders on the other nodes of the group
  (the next ones in node-id order) it `ray.put`s the block once as a numpy array (one copy into
  the object store, no pickling copy) and they copy it out into memory they own (the store's
  copy belongs to the rank and goes with it). Where the directory cannot hold the files, the own
  node's holder gets its copy through the store too. A push still in flight when the next is due
  is waited for.
- `HolderStore`: the engine's `SnapshotStore` (engine/checkpointing/recovery.py, where the
  protocol a restarted group resumes by lives) over every holder of the job Ray lists, a place
  being a node id, the rank's own node local.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

# The Ray namespace of a job's named actors: the snapshot holders here, the job registry
# (workers/registry.py, which takes it from here).
NAMESPACE = "elastron"
KEEP = 2
CALL_TIMEOUT_S = 10.0
LIST_TIMEOUT_S = 2.0
PREFIX = "elastron-snap-"


def holder_name(job_id: str, node_id: str) -> str:
    return f"{PREFIX}{job_id}-{node_id}"


class SnapshotHolder:
    """A node's in-memory snapshots of one job: rank -> {iteration: (world_size, layout, blob)},
    a blob being bytes (a replica, or the store fallback) or {"path", "nbytes"}: a slot file the
    rank wrote on this node."""

    def __init__(self, job_id: str, node_id: str, reap_files: bool = False):
        self.job_id, self.node_id = job_id, node_id
        self._by_rank: dict[int, dict[int, tuple[int, str, bytes]]] = {}
        if reap_files:  # the actor: its node's slot files of the job end with this process
            from workers.snapshot_files import remove_when_gone, snapshot_dir

            self._lifeline = remove_when_gone(snapshot_dir(job_id) / node_id)

    def ping(self) -> str:
        return self.node_id

    def put(self, rank: int, iteration: int, world_size: int, layout: str, blob) -> None:
        """`blob`: bytes, or the pusher's read-only numpy view of the object store, copied here."""
        self._keep(rank, iteration, world_size, layout, blob if isinstance(blob, bytes) else blob.tobytes())

    def put_file(
        self, rank: int, iteration: int, world_size: int, layout: str, path: str, nbytes: int
    ) -> None:
        """The rank sealed `iteration` into its slot file `path` on this node: whatever this
        holder listed under that file before (two snapshots ago) is gone, overwritten."""
        for kept in self._by_rank.values():
            for i in [i for i, (_, _, b) in kept.items() if isinstance(b, dict) and b["path"] == path]:
                del kept[i]
        self._keep(rank, iteration, world_size, layout, {"path": path, "nbytes": nbytes})

    def _keep(self, rank: int, iteration: int, world_size: int, layout: str, blob) -> None:
        # A group of another shape (an elastic resize) trains on a timeline the old snapshots are
        # not part of: they are dropped, so a later group of the old shape cannot go back to them.
        for kept in self._by_rank.values():
            for i in [i for i, (w, lay, _) in kept.items() if (w, lay) != (world_size, layout)]:
                del kept[i]
        kept = self._by_rank.setdefault(rank, {})
        kept[iteration] = (world_size, layout, blob)
        for old in sorted(kept)[:-KEEP]:
            del kept[old]

    def available(self, rank: int, world_size: int, layout: str) -> list[int]:
        """Iterations held for this rank of this group shape, newest first."""
        kept = self._by_rank.get(rank, {})
        return sorted(
            (i for i, (w, lay, _) in kept.items() if (w, lay) == (world_size, layout)), reverse=True
        )

    def get(self, rank: int, iteration: int, inline: bool = False) -> bytes | dict | None:
        """The blob, or where its slot file is for a rank on this node to read (`inline`: the
        file's bytes, for a rank on another node)."""
        from workers.snapshot_files import read_slot

        entry = self._by_rank.get(rank, {}).get(iteration)
        if entry is None:
            return None
        blob = entry[2]
        return read_slot(blob["path"], blob["nbytes"]) if inline and isinstance(blob, dict) else blob

    def drop_files(self) -> None:
        """The job is over: remove its slot files on this node."""
        from workers.snapshot_files import drop_job_files

        drop_job_files(self.job_id)

    def forget_after(self, iteration: int) -> None:
        """Drop snapshots newer than the one the group resumed from: they are another timeline."""
        for kept in self._by_rank.values():
            for i in [i for i in kept if i > iteration]:
                del kept[i]

    def stats(self) -> dict[str, Any]:
        return {
            "ranks": {r: sorted(k) for r, k in self._by_rank.items()},
            "bytes": sum(
                b["nbytes"] if isinstance(b, dict) else len(b)
                for k in self._by_rank.values()
                for _, _, b in k.values()
            ),
        }


def holder(job_id: str, node_id: str):
    """The holder of `job_id` on `node_id`, started there if it is not running yet. Called by the
    job registry (`JobRegistry.snapshot_holders`): the caller owns what it starts, and a holder
    must be owned by the driver's side, never by a rank."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from workers.warm_processes import no_preload_runtime_env

    return (
        ray.remote(num_cpus=0, max_restarts=0)(SnapshotHolder)
        .options(
            name=holder_name(job_id, node_id),
            namespace=NAMESPACE,
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env=no_preload_runtime_env(),  # it needs numpy, not the rank's torch preload
        )
        .remote(job_id, node_id, reap_files=True)
    )


def existing_holders(job_id: str) -> dict[str, Any]:
    """node id -> handle of every holder of this job that Ray still lists."""
    import ray

    prefix = holder_name(job_id, "")
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE or not entry["name"].startswith(prefix):
            continue
        with contextlib.suppress(ValueError):
            out[entry["name"][len(prefix) :]] = ray.get_actor(entry["name"], namespace=NAMESPACE)
    return out


def kill_holders(job_id: str) -> None:
    import ray

    handles = list(existing_holders(job_id).values())
    drops = []
    for handle in handles:
        with contextlib.suppress(Exception):
            drops.append(handle.drop_files.remote())
    with contextlib.suppress(Exception):
        ray.wait(drops, num_returns=len(drops), timeout=LIST_TIMEOUT_S)
    for handle in handles:
        with contextlib.suppress(Exception):
            ray.kill(handle)


def replica_nodes(my_node: str, group_nodes: list[str], replicas: int) -> list[str]:
    """The `replicas` nodes after mine in the group's node-id order (wrapping), never mine."""
    others = sorted(set(group_nodes) - {my_node})
    if not others or replicas <= 0:
        return []
    after = [n for n in others if n > my_node] + [n for n in others if n < my_node]
    return after[:replicas]


class SnapshotPusher:
    """The rank's side: capture in the training thread, push from a background thread."""

    def __init__(self, job_id: str, rank: int, my_node: str, group_nodes: list[str], replicas: int, registry):
        import ray

        from workers.snapshot_files import SlotFiles

        self.job_id, self.rank, self.my_node = job_id, rank, my_node
        self.targets = [my_node, *replica_nodes(my_node, group_nodes, replicas)]
        # The registry starts them (the driver's side owns them; see the module docstring).
        try:
            self._holders = ray.get(registry.snapshot_holders.remote(self.targets), timeout=CALL_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - no holders costs recovery speed, not training
            log.warning("no in-memory snapshots: the job registry did not start their holders (%s)", err)
            self._holders = {}
        # One slot more than the holders list: the one being written is never one a recovery may read.
        self._files: SlotFiles | None = SlotFiles(job_id, rank, slots=KEEP + 1, node_id=my_node)
        self._size = 0  # the last snapshot's block: the slot files are sized from it
        self._buffer: bytearray | None = None  # the capture buffer when no slot file is used
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None
        self.pushed: int | None = None  # newest iteration every target holds
        self.capture_s: list[float] = []

    def snapshot(self, trainer) -> None:
        """Called by the engine when a snapshot is due (RankHooks.on_snapshot_due)."""
        if not self._holders:
            return
        self.wait()
        started = time.perf_counter()
        slot, buffer = None, self._buffer
        if self._files is not None and self._size:  # the first snapshot tells the size
            try:
                slot, buffer = self._files.buffer(self._size)
            except OSError as err:
                log.warning(
                    "in-memory snapshots go through the object store: %s cannot hold them (%s)",
                    self._files.dir,
                    err,
                )
                self._files = None
        snap = trainer.capture_snapshot(buffer)
        self._size = len(snap.block)
        if slot is not None and snap.block.obj is not buffer:  # it outgrew the slot: resized next time
            slot = None
        if slot is None:
            self._buffer = snap.block.obj  # reused by the next capture (touched pages are faster)
        else:
            self._files.advance()
        self.capture_s.append(time.perf_counter() - started)
        path = str(self._files.paths[slot]) if slot is not None else None
        self._thread = threading.Thread(
            target=self._push, args=(snap, path), daemon=True, name="snapshot-push"
        )
        self._thread.start()

    def _push(self, snap, path: str | None) -> None:
        import numpy as np
        import ray

        try:
            block = snap.seal()
            where = (self.rank, snap.iteration, snap.world_size, snap.layout)
            calls, through_store = [], list(self._holders.items())
            if path is not None:  # the own node's copy is the file itself
                calls.append(self._holders[self.my_node].put_file.remote(*where, path, len(block)))
                through_store = [(n, h) for n, h in through_store if n != self.my_node]
            if through_store:
                blob = ray.put(np.frombuffer(block, dtype=np.uint8))
                calls += [h.put.remote(*where, blob) for _, h in through_store]
            ray.get(calls, timeout=CALL_TIMEOUT_S)
            self.pushed = snap.iteration
        except Exception as err:  # noqa: BLE001 - a lost holder costs recovery speed, not training
            self.last_error = err
            log.warning("in-memory snapshot of iteration %d not pushed: %s", snap.iteration, err)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class HolderStore:
    """The engine's SnapshotStore (engine/checkpointing/recovery.py) over the job's holders, as
    a rank sees them: a place is a node id, `my_node` the local one."""

    def __init__(self, job_id: str, my_node: str):
        self.job_id, self.my_node = job_id, my_node
        self._holders = existing_holders(job_id)

    def is_local(self, where: str) -> bool:
        return where == self.my_node

    def put(self, rank: int, iteration: int, world_size: int, layout: str, blob: bytes) -> None:
        import ray

        ray.get(
            [h.put.remote(rank, iteration, world_size, layout, blob) for h in self._holders.values()],
            timeout=CALL_TIMEOUT_S,
        )

    def available(self, rank: int, world_size: int, layout: str) -> dict[int, list[str]]:
        import ray

        refs = {h.available.remote(rank, world_size, layout): node for node, h in self._holders.items()}
        # A holder on a node that vanished (and is not marked dead yet) does not answer: not waited for.
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=LIST_TIMEOUT_S) if refs else ([], [])
        where: dict[int, list[str]] = {}
        for ref in ready:
            try:
                iterations = ray.get(ref)
            except Exception:  # noqa: BLE001 - a holder on a lost node
                continue
            for it in iterations:
                where.setdefault(it, []).append(refs[ref])
        return where

    def get(self, rank: int, iteration: int, where: str) -> bytes | None:
        import ray

        from workers.snapshot_files import read_slot

        here = self.is_local(where)
        blob = ray.get(self._holders[where].get.remote(rank, iteration, not here), timeout=CALL_TIMEOUT_S)
        if isinstance(blob, dict):  # a slot file on this node
            blob = read_slot(blob["path"], blob["nbytes"])
        return blob

    def forget_after(self, iteration: int) -> None:
        for h in self._holders.values():
            with contextlib.suppress(Exception):
                h.forget_after.remote(iteration)
