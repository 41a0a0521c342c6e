"""Save and resume a Trainer's checkpoint: DCP shards + the commit protocol + storage.

A save: every rank streams its DCP shard files straight to storage (raw_io; on S3 multipart
uploads fed from memory, no staging copy), checksumming them as they go, reports (name, size,
checksums) to rank 0, and rank 0 commits: manifest last, then `latest`, then retention. A
checkpoint without a manifest never loads, so a crash at any point leaves the previous one as the newest.

The manifest's `meta` holds the non-tensor state in plain JSON (iteration, consumed samples, LR
schedule, loss scaler, Adam's step, the layout, the job spec, the rerun state machine's state),
readable without torch.

A resume: pick the checkpoint (newest under this job's root with `resume: auto`, or
`resume_from`), have one process per machine check that every file is there (commit.open_checkpoint),
then DCP loads exactly the slices this layout needs, straight from storage, each checked against
the manifest's checksums as it is read; a corrupt or missing shard fails the load on every rank
(falling back to the previous committed checkpoint, for `auto`). RNG states come back only when
the layout is the one that saved them; on any other layout each rank reseeds from (seed, iteration).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from engine import parallel_state as ps
from engine.checkpointing import raw_io
from engine.checkpointing import state as ckpt_state
from engine.checkpointing.commit import (
    CheckpointCorruptError,
    OpenCheckpoint,
    ShardCorruptError,
    commit_checkpoint,
    committed_iterations,
    corrupt_error,
    delete_iteration,
    iteration_key,
    latest_checkpoint,
    open_checkpoint,
    resolve_checkpoint,
)
from engine.checkpointing.storage import Storage, open_storage
from engine.tensor_parallel import model_parallel_manual_seed

log = logging.getLogger(__name__)
_ITER = re.compile(r"^(.*?)/?(iter_\d{7})/?$")

# Files per rank DCP writes (and checksums, and uploads) in parallel.
WRITER_THREADS = 4

# Test seam for crash drills: called on every rank after its shards are written, before the
# commit (a test sets it inside a rank process to kill that rank mid-save).
_FAULT_HOOK = None


def layout_signature(trainer) -> str:
    g = ps.get_grid()
    p = trainer.spec.parallel
    return f"tp{g.tp}-pp{g.pp}-vp{p.virtual_pipeline or 1}-cp{g.cp}-dp{g.dp}-layers{p.pipeline_layers}"


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Checkpointer:
    def __init__(self, trainer):
        self.trainer = trainer
        self.spec = trainer.spec.checkpoint
        self.job_root = trainer.spec.name
        self.storage: Storage | None = None
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self._group = None
        self._host_buffers: dict = {}
        self._started = 0.0  # when the save in progress began (saves never overlap)
        if self.spec.path:
            self.storage = open_storage(
                self.spec.path, endpoint_url=self.spec.endpoint_url, region=self.spec.region
            )

    # ---------------------------------------------------------------- save
    def save(self) -> None:
        """Checkpoint the current iteration. With checkpoint.async_save the call returns once the
        state is copied to host memory and the writing goes on in the background; either way a
        previous save still in flight is finished first."""
        trainer = self.trainer
        if self.storage is None:
            raise RuntimeError("checkpoint.path is not set: nowhere to save")
        self.wait()
        self._started = time.perf_counter()
        state = ckpt_state.build_state_dict(trainer)
        meta = self._meta()
        if not self.spec.async_save:
            try:
                self._write(state, trainer.iteration, meta, group=None)
            except Exception as err:
                self._failed(trainer.iteration, err)
                raise
            return
        if self._group is None:  # its own group: background collectives never meet training's
            self._group = dist.new_group(backend="gloo")
        snapshot = ckpt_state.snapshot(state, self._host_buffers)
        self._pending = threading.Thread(
            target=self._write_in_background, args=(snapshot, trainer.iteration, meta), daemon=True
        )
        self._pending.start()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its failure."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise RuntimeError("the background checkpoint save failed") from err

    def _write_in_background(self, state: dict, iteration: int, meta: dict) -> None:
        try:
            self._write(state, iteration, meta, group=self._group)
        except BaseException as err:  # noqa: BLE001 - handed to the training thread by wait()
            log.exception("background checkpoint save of iteration %d failed", iteration)
            self._failed(iteration, err)
            self._pending_error = err

    def _failed(self, iteration: int, err: BaseException) -> None:
        self.trainer.events.append(
            "checkpoint_failed", iteration=iteration, message=f"{type(err).__name__}: {err}"
        )

    def _write(self, state: dict, iteration: int, meta: dict, group) -> None:
        key = iteration_key(self.job_root, iteration)
        rank = dist.get_rank()
        if rank == 0:
            # Debris of a crashed save of this iteration, or a committed one being redone after a
            # fall-back resume: clear it (manifest first, so a crash here is still safe).
            delete_iteration(self.storage, self.job_root, iteration)
        dist.barrier(group=group)
        writer = raw_io.RawStorageWriter(self.storage, key, thread_count=WRITER_THREADS)
        dcp.save(state, storage_writer=writer, process_group=group)
        entries = writer.entries  # checksummed as written: nothing is read back
        if _FAULT_HOOK is not None:
            _FAULT_HOOK(iteration)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entries, group=group)
        if rank == 0:
            files = [e for per_rank in gathered for e in per_rank]
            commit_checkpoint(self.storage, self.job_root, iteration, files, meta, keep=self.spec.keep)
            # The job's event record (and through the workers, the control plane) learns of it.
            self.trainer.events.append(
                "checkpoint_saved",
                iteration=iteration,
                seconds=time.perf_counter() - self._started,
                bytes=sum(e.size for e in files),
                uri=f"{self.spec.path.rstrip('/')}/{key}",
            )
        dist.barrier(group=group)

    def _meta(self) -> dict:
        t = self.trainer
        opt = t.optimizer
        adam_steps = [int(s["step"]) for s in opt.inner.state.values() if "step" in s]
        return {
            "shard_format": raw_io.FORMAT,
            "iteration": t.iteration,
            "consumed_samples": t.consumed_samples,
            "adam_step": max(adam_steps, default=0),
            "has_master": any(opt.needs_copy_back),
            "layout": layout_signature(t),
            "scheduler": t.scheduler.state_dict(),
            "grad_scaler": t.grad_scaler.state_dict() if t.grad_scaler is not None else None,
            "job": t.spec.model_dump(mode="json"),
            "rerun": self._rerun_state(),
        }

    def _rerun_state(self) -> dict:
        """The rerun state machine's common state and every rank's own (gathered: it is small)."""
        common, mine = self.trainer.rerun.state_dict()
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        return {"common": common, "ranks": ranks}

    # ---------------------------------------------------------------- resume
    def _open(self, uri: str) -> Storage:
        return open_storage(uri, endpoint_url=self.spec.endpoint_url, region=self.spec.region)

    def _candidates(self) -> tuple[str, str, list[int]] | str | None:
        """(storage uri, job root, iterations newest first) to resume from; None to start
        fresh; an error message when resume_from names nothing loadable."""
        # A job's own checkpoints win: a restarted job continues where it was, not from the
        # checkpoint it was started from.
        if self.storage is not None and self.spec.resume == "auto":
            newest = latest_checkpoint(self.storage, self.job_root)
            if newest is not None:
                older = [i for i in reversed(committed_iterations(self.storage, self.job_root)) if i < newest]
                return self.spec.path, self.job_root, [newest, *older]
        if self.spec.resume_from:
            uri = self.spec.resume_from.rstrip("/")
            m = _ITER.match(uri)
            root_uri, key = (m.group(1) or ".", m.group(2)) if m else (uri, "")
            found = resolve_checkpoint(self._open(root_uri), key)
            if found is None:
                return f"checkpoint.resume_from: no committed checkpoint at {self.spec.resume_from}"
            return root_uri, found[0], [found[1]]
        return None

    def maybe_resume(self) -> int | None:
        """Load the checkpoint this job should continue from; returns its iteration, or None."""
        choice = _broadcast(self._candidates() if dist.get_rank() == 0 else None)
        if choice is None:
            return None
        if isinstance(choice, str):
            raise FileNotFoundError(choice)
        uri, job_root, iterations = choice
        storage = self._open(uri)
        cache = Path(tempfile.gettempdir()) / "elastron-ckpt-cache" / f"{self.trainer.spec.name}"
        fetcher = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
        for iteration in iterations:
            # One process per machine reads the manifest and checks the files are all there; the
            # others get the opened checkpoint from it. Each rank then reads only what it loads.
            outcome = None
            if fetcher:
                try:
                    outcome = open_checkpoint(
                        storage, job_root, iteration, cache, check_now=[raw_io.METADATA]
                    )
                except CheckpointCorruptError as err:
                    outcome = err
            results = [None] * dist.get_world_size()
            dist.all_gather_object(results, outcome)
            errors = [r for r in results if isinstance(r, CheckpointCorruptError)]
            if errors:
                if self.spec.resume_from or iteration == iterations[-1]:
                    raise errors[0]
                log.warning("%s; falling back to the previous committed checkpoint", errors[0])
                continue
            opened = next(r for r in results if isinstance(r, OpenCheckpoint))
            try:
                self._load(opened, opened.meta)
            except ShardCorruptError as err:  # found while reading, on every rank at once
                error = corrupt_error(storage, job_root, iteration, err.problems)
                if self.spec.resume_from or iteration == iterations[-1]:
                    raise error from err
                log.warning("%s; falling back to the previous committed checkpoint", error)
                continue
            return iteration
        return None

    def _load(self, opened: OpenCheckpoint, meta: dict) -> None:
        t = self.trainer
        same_layout = meta["layout"] == layout_signature(t)
        with_master = bool(meta["has_master"]) and any(t.optimizer.needs_copy_back)
        target, buffers = ckpt_state.empty_state_dict(t, with_master=with_master, with_rng=same_layout)
        if meta.get("shard_format") != raw_io.FORMAT:
            raise ValueError(f"checkpoint shard format {meta.get('shard_format')!r} is not {raw_io.FORMAT!r}")
        raw_io.load(target, opened)
        ckpt_state.apply_state_dict(t, target, buffers, meta["adam_step"], with_master, with_rng=same_layout)
        t.iteration = meta["iteration"]
        t.consumed_samples = meta["consumed_samples"]
        changed = t.scheduler.load_state_dict(meta["scheduler"], strict=False)
        if changed and dist.get_rank() == 0:
            log.warning(
                "resumed with this job's lr / weight-decay schedule, not the checkpoint's: %s",
                "; ".join(changed),
            )
        if t.grad_scaler is not None and meta["grad_scaler"] is not None:
            t.grad_scaler.load_state_dict(meta["grad_scaler"])
        if meta.get("rerun"):
            mine = meta["rerun"]["ranks"][dist.get_rank()] if same_layout else None
            t.rerun.load_state_dict(meta["rerun"]["common"], mine)
        if not same_layout:
            # A new layout has new RNG positions: seed them from (seed, iteration), deterministically.
            model_parallel_manual_seed(t.spec.training.seed + t.iteration)
