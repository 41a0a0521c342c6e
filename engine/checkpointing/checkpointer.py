"""Save and resume the named stateful parts of training: DCP shards + the commit protocol + storage.

The checkpointer knows no trainer: it is handed a mapping of named parts, each a `Stateful`
(stateful.py: model weights, optimizer state, RNG streams, data position, LR schedule, loss
scaler, rerun state machine, the job record), and splits each part's state dict into shards
(tensors, under "<part>/<key>") and manifest meta (everything else). So a new kind of state
(FSDP, an import from another format, an in-memory copy) plugs in as a part; the checkpointer
only needs its own settings, the job's name (its storage root), the event log and the layout.

A save: every rank streams its DCP shard files straight to storage (raw_io; on S3 multipart
uploads fed from memory, no staging copy), checksumming them as they go, reports (name, size,
checksums) to rank 0, and rank 0 commits: manifest last, then `latest`, then retention. A
checkpoint without a manifest never loads, so a crash at any point leaves the previous one as the newest.

The manifest's `meta` holds the non-tensor state in plain JSON (iteration, consumed samples, LR
schedule, loss scaler, Adam's step, the layout, the job spec, the rerun state machine's state),
readable without torch. Its `iteration` (the data position's) names the checkpoint.

A resume: pick the checkpoint (newest under this job's root with `resume: auto`, or
`resume_from`), have one process per machine check that every file is there (commit.open_checkpoint)
and read which parts it holds tensors of, then DCP loads exactly the slices this layout needs,
straight from storage, each checked against the manifest's checksums as it is read; a corrupt or
missing shard fails the load on every rank (falling back to the previous committed checkpoint, for
`auto`). Parts get their loaded state only once every tensor has loaded (restore.py: the same
routine restores an in-memory snapshot). State of a part this
checkpointer was not given, or a part the checkpoint has no tensors of, is an error rather than a
silently partial resume. Parts learn whether the layout is the one that saved them
(stateful.SavedCheckpoint): RNG states come back only then; on any other layout each rank reseeds
from (seed, iteration). Nothing read from storage is executed: the DCP metadata is JSON
(metadata_json.py), and a checkpoint of the old pickled format stops the resume on every rank
(no fallback to an older one) with OldCheckpointFormatError naming `elastron checkpoint convert`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from engine import parallel_state as ps
from engine.checkpointing import raw_io
from engine.checkpointing import state as ckpt_state
from engine.checkpointing.backends import open_storage
from engine.checkpointing.commit import (
    CheckpointCorruptError,
    OpenCheckpoint,
    ShardCorruptError,
    apply_retention,
    commit_checkpoint,
    committed_iterations,
    corrupt_error,
    delete_iteration,
    iteration_key,
    latest_checkpoint,
    open_checkpoint,
    resolve_checkpoint,
)
from engine.checkpointing.metadata_json import (
    CheckpointFormatError,
    OldCheckpointFormatError,
    old_format_message,
)
from engine.checkpointing.restore import is_tensor, restore_parts
from engine.checkpointing.save_failures import CheckpointStorageError, SaveFailures, describe, out_of_space
from engine.checkpointing.stateful import SavedCheckpoint, Stateful
from engine.checkpointing.storage import Storage
from engine.jobspec.layout import split_checkpoint_uri

if TYPE_CHECKING:
    from engine.jobspec import CheckpointSpec, ParallelSpec
    from engine.rerun.event_log import EventLog

log = logging.getLogger(__name__)

# Files per rank DCP writes (and checksums, and uploads) in parallel.
WRITER_THREADS = 4

# Test seam for crash drills: called on every rank after its shards are written, before the
# commit (a test sets it inside a rank process to kill that rank mid-save).
_FAULT_HOOK = None


# Meta keys the checkpointer writes itself; every other one comes from a part.
_OWN_META = ("shard_format", "layout")


def layout_signature(parallel: ParallelSpec) -> str:
    """The layout of the initialised rank grid: per-rank state is valid only on an equal one."""
    g, vp = ps.get_grid(), parallel.virtual_pipeline or 1
    return f"tp{g.tp}-pp{g.pp}-vp{vp}-cp{g.cp}-dp{g.dp}-layers{parallel.pipeline_layers}"


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _stored_parts(opened: OpenCheckpoint) -> set[str]:
    """The parts a checkpoint holds tensors of: the first component of its DCP keys."""
    metadata = raw_io.RawStorageReader(opened).read_metadata()
    return {key.split("/", 1)[0] for key in metadata.state_dict_metadata}


class Checkpointer:
    """Checkpoints `parts` under `job_name` as `spec` (the job's checkpoint section) says.

    `parts` is in the order every rank calls them (state dicts may be collectives); `events`
    gets checkpoint_saved / checkpoint_failed; `layout` is this rank grid's `layout_signature`."""

    def __init__(
        self,
        parts: Mapping[str, Stateful],
        spec: CheckpointSpec,
        *,
        job_name: str,
        events: EventLog,
        layout: str,
    ):
        for name, part in parts.items():
            if not name or "/" in name:
                raise ValueError(f"checkpoint part name {name!r}: must be non-empty and without '/'")
            if not isinstance(part, Stateful):
                raise TypeError(f"checkpoint part {name!r} has no state_dict() / load_state_dict()")
        self.parts = dict(parts)
        self.spec = spec
        self.job_root = job_name
        self.events = events
        self.layout = layout
        self.storage: Storage | None = None
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self._group = None
        self._host_buffers: dict = {}
        self._started = 0.0  # when the save in progress began (saves never overlap)
        self.failures = SaveFailures(
            spec.on_save_failure, spec.save_retries, spec.save_retry_backoff_s, spec.max_consecutive_failures
        )
        # Rank 0, synchronous saves: called with the iteration once its checkpoint is committed,
        # before the save's closing collective (train_loop hands the step's record on there).
        self.on_commit: Callable[[int], None] | None = None
        # Rank 0: called with the iteration just before its checkpoint is committed; a launcher
        # that learns its attempt was replaced (fenced) never returns from it (workers/fencing.py).
        self.before_commit: Callable[[int], None] | None = None
        if self.spec.path:
            self.storage = open_storage(
                self.spec.path, endpoint_url=self.spec.endpoint_url, region=self.spec.region
            )

    # ---------------------------------------------------------------- save
    def save(self) -> None:
        """Checkpoint the current iteration. With checkpoint.async_save the call returns once the
        state is copied to host memory and the writing goes on in the background.

        At most one save is in flight: a previous one still writing is waited for first, never
        skipped and never stacked. Waiting keeps every interval's checkpoint (the steps a crash
        can cost stay bounded by `interval`) and one host copy of the state (`_host_buffers`,
        reused), and it costs training time only when storage is slower than the interval (the
        wait is inside the caller's checkpoint-save timer). Skipping would leave the newest
        checkpoint ever further behind on slow storage, which is the case where a crash costs most.

        A storage failure is retried and then skipped or fatal as `save_failures.py` says; only
        `CheckpointStorageError` (the job must stop) leaves this method or `wait()`."""
        if self.storage is None:
            raise RuntimeError("checkpoint.path is not set: nowhere to save")
        self.wait()
        self._started = time.perf_counter()
        state, meta = self._collect()
        iteration = meta["iteration"]
        if not self.spec.async_save:
            self._save_with_retries(state, iteration, meta, group=None)
            self._raise_pending()
            return
        if self._group is None:  # its own group: background collectives never meet training's
            self._group = dist.new_group(backend="gloo")
        snapshot = ckpt_state.snapshot(state, self._host_buffers)
        self._pending = threading.Thread(
            target=self._write_in_background, args=(snapshot, iteration, meta), daemon=True
        )
        self._pending.start()

    def _collect(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every part's state: its tensors keyed "<part>/<key>" for DCP, the rest as meta."""
        tensors: dict[str, Any] = {}
        meta: dict[str, Any] = {"shard_format": raw_io.FORMAT, "layout": self.layout}
        owners = dict.fromkeys(meta, "the checkpointer")
        for name, part in self.parts.items():
            for key, value in part.state_dict().items():
                if is_tensor(value):
                    tensors[f"{name}/{key}"] = value
                elif key in meta:
                    raise ValueError(
                        f"checkpoint meta key {key!r} is written by {owners[key]} and by part {name!r}"
                    )
                else:
                    meta[key] = value
                    owners[key] = f"part {name!r}"
        if not isinstance(meta.get("iteration"), int):
            raise ValueError(
                "no checkpoint part gives the iteration that names the checkpoint (DataPosition does)"
            )
        return tensors, meta

    @property
    def saving(self) -> bool:
        """A background save is still writing (a launcher shutting a rank down gives it time)."""
        return self._pending is not None and self._pending.is_alive()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed or given up; raise what stops the
        job (CheckpointStorageError, or a collective's failure in the background save)."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            if isinstance(err, CheckpointStorageError):
                raise err
            raise RuntimeError("the background checkpoint save failed") from err

    def _write_in_background(self, state: dict, iteration: int, meta: dict) -> None:
        try:
            self._save_with_retries(state, iteration, meta, group=self._group)
        except BaseException as err:  # noqa: BLE001 - handed to the training thread by wait()
            log.exception("background checkpoint save of iteration %d failed", iteration)
            self._pending_error = err

    def _save_with_retries(self, state: dict, iteration: int, meta: dict, group) -> None:
        """One save, its storage failures retried with backoff; a save that still fails is
        skipped (an event) or recorded in `_pending_error` to stop the job. Every rank sees the
        same outcome of every attempt, so every rank retries, skips or stops together."""
        policy = self.failures
        retried, error = 0, None
        while True:
            error = self._attempt(state, iteration, meta, group, retried, make_room=out_of_space(error))
            if error is None:
                policy.succeeded()
                return
            if retried >= policy.retries:
                break
            retried += 1
            delay = policy.delay(retried)
            log.warning(
                "checkpoint save of iteration %d failed (%s); retry %d of %d in %.1f s",
                iteration, error, retried, policy.retries, delay,
            )
            time.sleep(delay)
        stop = policy.failed(iteration, error)
        if dist.get_rank() == 0:  # one event per save (every rank agreed on the outcome)
            self.events.append(
                "checkpoint_failed",
                iteration=iteration,
                message=error,
                retries=retried,
                consecutive=policy.consecutive,
                skipped=stop is None,
                seconds=time.perf_counter() - self._started,
            )
        if stop is not None:
            self._pending_error = stop
        elif dist.get_rank() == 0:
            log.error(
                "checkpoint save of iteration %d skipped after %d retries (%d in a row): %s; training goes on",
                iteration, retried, policy.consecutive, error,
            )

    def _attempt(
        self, state: dict, iteration: int, meta: dict, group, retried: int, make_room: bool = False
    ) -> str | None:
        """Write and commit one checkpoint; None when it is committed, else the storage error
        (the same string on every rank). A failed attempt leaves nothing of its iteration in
        storage: a half-written folder (a full disk, a quota, an upload cut off) is deleted, so
        its space is given back and no partial checkpoint remains; `latest` is only ever written
        after the manifest and replaced atomically, so it is never torn.

        Each storage step's outcome is agreed on with a collective (`_agree`): DCP's own write
        collective for the shards, a broadcast from rank 0 for its deletes and its commit. A
        collective that fails raises: a dead peer is no storage failure, retrying cannot help."""
        key = iteration_key(self.job_root, iteration)
        rank = dist.get_rank()
        # Debris of a crashed save of this iteration, or a committed one being redone after a
        # fall-back resume: clear it (manifest first, so a crash here is still safe).
        error = self._agree(self._on_rank0(lambda: self._prepare(iteration, make_room)), group)
        if error is not None:
            return error
        writer = raw_io.RawStorageWriter(self.storage, key, thread_count=WRITER_THREADS)
        try:
            dcp.save(state, storage_writer=writer, process_group=group)
        except CheckpointException as err:  # DCP raises every rank's write failure on every rank
            self._clean_up(iteration, group)
            return describe(err)
        entries = writer.entries  # checksummed as written: nothing is read back
        if _FAULT_HOOK is not None:
            _FAULT_HOOK(iteration)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entries, group=group)
        committed = None
        if rank == 0:
            files = [e for per_rank in gathered for e in per_rank]
            if self.before_commit is not None:
                self.before_commit(iteration)
            committed = self._on_rank0(
                lambda: commit_checkpoint(self.storage, self.job_root, iteration, files, meta)
            )
            if committed is None:
                self._retain()
                # The job's event record (and through the workers, the control plane) learns of it.
                self.events.append(
                    "checkpoint_saved",
                    iteration=iteration,
                    seconds=time.perf_counter() - self._started,
                    bytes=sum(e.size for e in files),
                    uri=f"{self.spec.path.rstrip('/')}/{key}",
                    retries=retried,
                )
                if group is None and self.on_commit is not None:
                    # Before the closing collective: a frozen peer must not keep this step's
                    # record (its checkpoint is committed: a resume never runs it again).
                    self.on_commit(iteration)
            else:
                self._delete_quietly(iteration)  # the manifest may be written, `latest` not
        return self._agree(committed, group)

    def _prepare(self, iteration: int, make_room: bool) -> None:
        """Rank 0, before an attempt: clear the iteration's folder; after a full disk or quota,
        also make room by keeping one committed checkpoint fewer than checkpoint.keep until this
        one commits (never fewer than one, never the one `latest` names): without it a full disk
        fails every later save, since retention only frees space after a commit."""
        delete_iteration(self.storage, self.job_root, iteration)
        if make_room and self.spec.keep > 1:
            log.warning(
                "storage full: keeping %d committed checkpoint(s) instead of %d to make room for iteration %d",
                self.spec.keep - 1, self.spec.keep, iteration,
            )
            apply_retention(self.storage, self.job_root, self.spec.keep - 1)

    def _clean_up(self, iteration: int, group) -> None:
        """After a failed shard write: rank 0 deletes what the attempt left (files other ranks or
        other streams had finished), once every rank's writing is over (DCP's failed collective
        already says so), and every rank waits for it."""
        if dist.get_rank() == 0:
            self._delete_quietly(iteration)
        dist.barrier(group=group)

    def _delete_quietly(self, iteration: int) -> None:
        try:
            delete_iteration(self.storage, self.job_root, iteration)
        except Exception as err:  # noqa: BLE001 - the next attempt (or retention) deletes it again
            log.warning("could not delete the failed save of iteration %d: %s", iteration, describe(err))

    def _retain(self) -> None:
        """Retention after a commit: a failure here costs space, never the committed checkpoint."""
        try:
            apply_retention(self.storage, self.job_root, self.spec.keep)
        except Exception as err:  # noqa: BLE001 - retried after the next commit
            log.warning("checkpoint retention in %s failed: %s", self.spec.path, describe(err))

    @staticmethod
    def _on_rank0(step) -> str | None:
        """Run a storage step on rank 0: None if it worked, else its error (other ranks: None)."""
        if dist.get_rank() != 0:
            return None
        try:
            step()
        except Exception as err:  # noqa: BLE001 - a storage failure, agreed on and retried
            log.warning("checkpoint storage step failed: %s", describe(err))
            return describe(err)
        return None

    @staticmethod
    def _agree(error: str | None, group) -> str | None:
        """Rank 0's outcome of a step, on every rank (the save's barrier)."""
        box = [error]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

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
            root_uri, key = split_checkpoint_uri(self.spec.resume_from)
            found = resolve_checkpoint(self._open(root_uri), key)
            if found is None:
                return f"checkpoint.resume_from: no committed checkpoint at {self.spec.resume_from}"
            return root_uri, found[0], [found[1]]
        return None

    def will_resume(self) -> bool:
        """Whether maybe_resume() will load (or fail to find) a checkpoint: rank 0 looks, every
        rank gets its answer. Lets a job skip work a resume would overwrite (an HF import)."""
        return _broadcast(self._candidates() is not None if dist.get_rank() == 0 else None)

    def maybe_resume(self) -> int | None:
        """Load the checkpoint this job should continue from; returns its iteration, or None."""
        choice = _broadcast(self._candidates() if dist.get_rank() == 0 else None)
        if choice is None:
            return None
        if isinstance(choice, str):
            raise FileNotFoundError(choice)
        uri, job_root, iterations = choice
        storage = self._open(uri)
        cache = Path(tempfile.gettempdir()) / "elastron-ckpt-cache" / f"{self.job_root}"
        fetcher = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
        for iteration in iterations:
            # One process per machine reads the manifest and checks the files are all there; the
            # others get the opened checkpoint from it. Each rank then reads only what it loads.
            outcome = None
            if fetcher:
                try:
                    opened = open_checkpoint(
                        storage, job_root, iteration, cache, check_now=[raw_io.METADATA]
                    )
                    outcome = (opened, _stored_parts(opened))
                except CheckpointCorruptError as err:
                    outcome = err
                except ShardCorruptError as err:  # its .metadata changed since it was checked
                    outcome = corrupt_error(storage, job_root, iteration, err.problems)
                except CheckpointFormatError as err:  # old (pickled) or foreign .metadata: never loaded
                    outcome = err
            results = [None] * dist.get_world_size()
            dist.all_gather_object(results, outcome)
            refused = [r for r in results if isinstance(r, CheckpointFormatError)]
            if refused:  # every rank stops with the fetcher's message; no fallback reads it either
                raise refused[0]
            errors = [r for r in results if isinstance(r, CheckpointCorruptError)]
            if errors:
                if self.spec.resume_from or iteration == iterations[-1]:
                    raise errors[0]
                log.warning("%s; falling back to the previous committed checkpoint", errors[0])
                continue
            opened, stored_parts = next(r for r in results if isinstance(r, tuple))
            try:
                self._load(opened, stored_parts)
            except ShardCorruptError as err:  # found while reading, on every rank at once
                error = corrupt_error(storage, job_root, iteration, err.problems)
                if self.spec.resume_from or iteration == iterations[-1]:
                    raise error from err
                log.warning("%s; falling back to the previous committed checkpoint", error)
                continue
            return iteration
        return None

    def _load(self, opened: OpenCheckpoint, stored_parts: set[str]) -> None:
        meta = opened.meta
        if meta.get("shard_format") in raw_io.OLD_FORMATS:
            raise OldCheckpointFormatError(old_format_message(raw_io.RawStorageReader(opened).checkpoint_id))
        if meta.get("shard_format") != raw_io.FORMAT:
            raise CheckpointFormatError(f"checkpoint shard format {meta.get('shard_format')!r} is not {raw_io.FORMAT!r}")
        saved = SavedCheckpoint(opened.iteration, meta, same_layout=meta["layout"] == self.layout)

        def load_tensors(targets: dict[str, dict[str, Any]]) -> None:
            self._check_parts(opened, stored_parts, targets)
            raw_io.load(
                {f"{name}/{k}": v for name, t in targets.items() for k, v in t.items() if is_tensor(v)},
                opened,
            )

        # The manifest's meta is one flat object: every part reads its values from all of it.
        restore_parts(self.parts, saved, load_tensors, dict.fromkeys(self.parts, meta))

    def _check_parts(self, opened: OpenCheckpoint, stored_parts: set[str], targets: dict[str, dict]) -> None:
        """Every part the checkpoint holds is one of ours, and every part of ours with tensors to
        load has them in the checkpoint: a resume restores all that was saved, or says why not."""
        where = f"checkpoint iteration {opened.iteration} of {opened.job_root!r}"
        claimed = set(_OWN_META)
        for target in targets.values():
            claimed.update(k for k, v in target.items() if not is_tensor(v))
        foreign = [f"tensors of part {name!r}" for name in sorted(stored_parts - self.parts.keys())]
        foreign += [f"meta {key!r}" for key in sorted(opened.meta.keys() - claimed)]
        if foreign:
            raise ValueError(
                f"{where} holds state that none of this job's checkpoint parts ({', '.join(self.parts)}) "
                f"restores: {', '.join(foreign)}; it was saved with other parts"
            )
        missing = [
            name
            for name, target in targets.items()
            if name not in stored_parts and any(is_tensor(v) for v in target.values())
        ]
        if missing:
            raise ValueError(f"{where} has no tensors of checkpoint part(s) {', '.join(map(repr, missing))}")
