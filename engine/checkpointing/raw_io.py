"""DCP storage writer/reader that keep each tensor's raw bytes in a `Storage`, checksummed in passing.

torch's FileSystemWriter runs torch.save per tensor item and its reader torch.load's each one
and copies it again; on a 1.14 GiB checkpoint that made the save 3.6x and the load 6.8x slower
than writing/reading the same bytes (bench/checkpoint_io.py). Here a tensor item is its
contiguous bytes at (offset, length) in the rank's file, recorded in DCP's own metadata like
any storage item, so DCP still plans which slices each rank of any layout reads.

The bytes go through `Storage` (storage.py), not through a local folder: a save streams each
file to its key (on S3 a multipart upload fed from the tensors, with no staging file), and a
load reads each run of adjacent items with one request straight into the tensors that want
them (on S3 ranged GETs; locally preadv), or into a buffer that is narrowed and copied when a
tensor wants part of a stored chunk.

Integrity rides along instead of costing a pass of its own: the writer computes each item's
CRC-32 from the bytes it sends (its `entries` feed the manifest, commit.py), and the reader
checks every item it reads against the manifest before handing it to DCP, raising
ShardCorruptError, which DCP delivers to every rank, so all ranks fail the load together and
can fall back together. A failed load may have left part of a corrupt tensor in a parameter
(whole chunks are read in place); the caller falls back to another checkpoint, whose load
overwrites every loaded tensor, or stops.

Planning, deduplication and the file naming __<rank>_<n>.distcp, several files per rank written
by parallel threads, follow DCP's FileSystemWriter, so the tensor bytes are laid out as before.
Nothing read from storage is ever unpickled (format "raw-v2", named in the manifest's meta):
`.metadata` is JSON (metadata_json.py), not DCP's pickle, and a non-tensor item (BYTE_IO: DCP
would torch.save it and torch.load it with weights_only=False) is a JSON value, written from the
planner's object and read back by `JsonLoadPlanner`; this reader hands such an item to no other
planner. A raw-v1 checkpoint (pickled `.metadata`) is refused with OldCheckpointFormatError naming
`elastron checkpoint convert` (convert.py), the admin-run command that rewrites it.
It leans on private DCP names (`_split_by_size_and_type`, `_StorageInfo`, `set_element`) and
`narrow_tensor_by_index`; the torch pin (< 2.14) keeps them stable, and the checkpoint tests
(resharding matrix, resume, corruption, no pickle) fail loudly if an upgrade moves them.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from engine.checkpointing import metadata_json
from engine.checkpointing.commit import Checksums, FileEntry, OpenCheckpoint, ShardCorruptError, crc32_hex
from engine.checkpointing.metadata_json import OldCheckpointFormatError, old_format_message
from engine.checkpointing.storage import MiB, Storage

FORMAT = "raw-v2"
# Formats whose `.metadata` is a pickle: loaded only after `elastron checkpoint convert`.
OLD_FORMATS = ("raw-v1",)
METADATA = ".metadata"
# Adjacent items are read with one request up to this many bytes (a small tensor is not worth
# a GET of its own); a bigger item is one run, which S3 splits into parallel ranged GETs.
RUN_BYTES = 64 * MiB
# An item is checksummed and sent in slices this big, so the CRC reads bytes still in cache.
_SLICE = 4 * MiB


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, including bf16)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


@dataclasses.dataclass(frozen=True)
class _FilePrefix:
    """A rank's file name prefix (`__<rank>_`), handed from the global plan to its writer."""

    prefix: str


class RawStorageWriter(StorageWriter):
    """Writes every rank's items under `folder` of `storage`. After the save, `entries` lists the
    files this rank wrote, with their checksums (the coordinator's also has `.metadata`)."""

    def __init__(self, storage: Storage, folder: str, thread_count: int = 1) -> None:
        super().__init__()
        self.storage, self.folder, self.thread_count = storage, folder, thread_count
        self.entries: list[FileEntry] = []
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Any = None) -> None:
        self.entries = []
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(plan, storage_data=_FilePrefix(f"__{i}_")) for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        buckets = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]

        def write_file(number: int, items) -> tuple[list[WriteResult], FileEntry]:
            name = f"{prefix}{number}{DEFAULT_SUFFIX}"
            results, chunks, offset = [], [], 0
            with self.storage.open_write(_join(self.folder, name)) as out:
                for item in items:
                    if item.type == WriteItemType.BYTE_IO:
                        view = memoryview(_json_item(planner, item))
                    else:
                        view = _bytes_of(planner.resolve_data(item).detach().cpu().contiguous())
                    crc = 0
                    for start in range(0, len(view), _SLICE):
                        piece = view[start : start + _SLICE]
                        crc = zlib.crc32(piece, crc)
                        out.write(piece)
                    if len(view):
                        chunks.append((offset, len(view), f"{crc:08x}"))
                    results.append(
                        WriteResult(
                            index=item.index,
                            size_in_bytes=len(view),
                            storage_data=_StorageInfo(name, offset, len(view)),
                        )
                    )
                    offset += len(view)
            return results, FileEntry(name, offset, tuple(chunks))

        with ThreadPoolExecutor(max_workers=max(1, len(buckets))) as pool:
            per_file = list(pool.map(write_file, range(len(buckets)), buckets))
        self.entries.extend(entry for _results, entry in per_file)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for results, _entry in per_file for r in results])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for per_rank in results for wr in per_rank}
        metadata.storage_meta = self.storage_meta()
        data = metadata_json.encode(metadata)
        self.storage.put_bytes(_join(self.folder, METADATA), data)
        self.entries.append(FileEntry(METADATA, len(data), ((0, len(data), crc32_hex(data)),)))

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return _join(self.storage.uri.rstrip("/"), self.folder)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # always handed over explicitly, never picked by DCP from a path


class RawStorageReader(StorageReader):
    """Reads a checkpoint opened by `commit.open_checkpoint`, checking what it reads when the
    checkpoint asks for it (`verify_on_read`), with up to `thread_count` runs in flight."""

    def __init__(self, checkpoint: OpenCheckpoint, thread_count: int | None = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.thread_count = thread_count or checkpoint.storage.concurrency
        self.storage_data: dict = {}
        self.load_id = uuid.uuid4().hex
        self._checks = (
            {e["name"]: Checksums(e) for e in checkpoint.files} if checkpoint.verify_on_read else None
        )
        self._planner_lock = threading.Lock()  # DCP does not promise a thread-safe planner
        self._decoded: Metadata | None = None  # read_metadata's answer: the file is read once

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        return _join(self.checkpoint.storage.uri.rstrip("/"), self.checkpoint.folder)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def _problem(self, name: str, offset: int, data) -> str | None:
        if self._checks is None:
            return None
        checks = self._checks.get(name)
        return "not listed in the manifest" if checks is None else checks.problem(offset, data)

    def read_metadata(self) -> Metadata:
        """The checkpoint's DCP metadata, decoded from JSON (never unpickled: metadata_json.py).
        OldCheckpointFormatError for a raw-v1 checkpoint, CheckpointFormatError for bytes that
        are not ours, ShardCorruptError when they are not the bytes the manifest lists."""
        if self._decoded is not None:
            return self._decoded
        if self.checkpoint.meta.get("shard_format") in OLD_FORMATS:
            raise OldCheckpointFormatError(old_format_message(self.checkpoint_id))
        data = self.checkpoint.storage.get_bytes(_join(self.checkpoint.folder, METADATA))
        problem = self._problem(METADATA, 0, data)
        if problem is not None:
            raise ShardCorruptError([(METADATA, problem)])
        metadata = metadata_json.decode(data, self.checkpoint_id)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._decoded = metadata
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _stored_chunk(self, index) -> tuple[torch.dtype, torch.Size]:
        md = self._metadata.state_dict_metadata[index.fqn]
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(f"{index.fqn} is not a tensor in this checkpoint")
        chunks = md.chunks
        if (
            index.index is not None
            and index.index < len(chunks)
            and chunks[index.index].offsets == index.offset
        ):
            chunk = chunks[index.index]
        else:
            chunk = next(c for c in chunks if index.offset is None or c.offsets == index.offset)
        return md.properties.dtype, chunk.sizes

    def _runs(self, plan: LoadPlan) -> list[tuple[str, list[ReadItem]]]:
        """The plan's items as (file, items adjacent in it), each run at most RUN_BYTES unless one
        item is bigger."""
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        runs = []
        for name, reqs in per_file.items():
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            run: list[ReadItem] = []
            end = size = 0
            for req in reqs:
                info = self.storage_data[req.storage_index]
                if run and (info.offset != end or size + info.length > RUN_BYTES):
                    runs.append((name, run))
                    run, size = [], 0
                run.append(req)
                end, size = info.offset + info.length, size + info.length
            runs.append((name, run))
        return runs

    def _destination(self, req: ReadItem, planner: LoadPlanner) -> tuple[torch.Tensor | None, Any]:
        """(target tensor or None for bytes, the buffer the stored bytes are read into)."""
        info = self.storage_data[req.storage_index]
        if req.type == LoadItemType.BYTE_IO:
            return None, bytearray(info.length)
        dtype, sizes = self._stored_chunk(req.storage_index)
        nbytes = sizes.numel() * dtype.itemsize
        if nbytes != info.length:  # checked before anything is allocated for it
            raise ValueError(
                f"{info.relative_path}: {req.storage_index.fqn} is {info.length} bytes in the checkpoint's "
                f"metadata, not the {nbytes} its shape and dtype take"
            )
        with self._planner_lock:
            target = planner.resolve_tensor(req).detach()
        whole = tuple(req.lengths) == tuple(sizes) and not any(req.storage_offsets)
        if whole and target.is_contiguous() and target.dtype == dtype and target.device.type == "cpu":
            buf = target  # straight into the tensor that wants it
        else:
            buf = torch.empty(sizes, dtype=dtype)
        return target, buf

    def _read_run(self, name: str, reqs: list[ReadItem], planner: LoadPlanner) -> tuple[str, str] | None:
        """Read one run with one request; check and hand over each item. (name, why) if it is bad."""
        dests = [self._destination(req, planner) for req in reqs]
        views = [memoryview(buf) if target is None else _bytes_of(buf) for target, buf in dests]
        start = self.storage_data[reqs[0].storage_index].offset
        try:
            self.checkpoint.storage.read_into(_join(self.checkpoint.folder, name), start, views)
        except FileNotFoundError:
            return name, "missing from storage"
        except EOFError as err:
            return name, f"truncated: {err}"
        for req, (target, buf), view in zip(reqs, dests, views, strict=True):
            problem = self._problem(name, self.storage_data[req.storage_index].offset, view)
            if problem is not None:
                return name, problem
            if target is None:  # a non-tensor item: JSON, to our planner only (never torch.load)
                if not isinstance(planner, JsonLoadPlanner):
                    raise TypeError(
                        f"{req.storage_index.fqn}: non-tensor checkpoint items are read with raw_io.JsonLoadPlanner, "
                        f"not {type(planner).__name__} (whose load_bytes may unpickle)"
                    )
                value = metadata_json.decode_value(req.storage_index.fqn, buf, self.checkpoint_id)
                with self._planner_lock:
                    planner.set_value(req, value)
                continue
            if buf is not target:
                target.copy_(narrow_tensor_by_index(buf, req.storage_offsets, req.lengths))
            with self._planner_lock:
                planner.commit_tensor(req, target)
        return None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        runs = self._runs(plan)
        with ThreadPoolExecutor(max_workers=max(1, min(self.thread_count, len(runs)))) as pool:
            outcomes = list(pool.map(lambda run: self._read_run(*run, planner), runs))
        problems = [p for p in outcomes if p is not None]
        if problems:
            raise ShardCorruptError(problems)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _json_item(planner: SavePlanner, item) -> bytes:
    """A BYTE_IO item's value as JSON (DCP's planner would torch.save it: a pickle)."""
    if not isinstance(planner, DefaultSavePlanner):
        raise TypeError(f"non-tensor checkpoint items need DCP's DefaultSavePlanner, not {type(planner).__name__}")
    return metadata_json.encode_value(item.index.fqn, planner.lookup_object(item.index))


class JsonLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a non-tensor item is a JSON value set by the
    reader (`set_value`); its `load_bytes` (DCP's torch.load, weights_only=False) never runs."""

    def set_value(self, read_item: ReadItem, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        if isinstance(self.state_dict.get(fqn), torch.Tensor):
            raise metadata_json.CheckpointFormatError(
                f"checkpoint item {fqn!r} is a tensor here but a non-tensor value in the checkpoint's .metadata"
            )
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise TypeError(f"{read_item.dest_index.fqn}: non-tensor checkpoint items are JSON, set by RawStorageReader")


def load(state_dict: dict[str, Any], checkpoint: OpenCheckpoint, process_group=None) -> None:
    """`dcp.load` through RawStorageReader and JsonLoadPlanner. Corruption any rank finds is raised
    on every rank as one ShardCorruptError listing all of it; a format problem (an old or foreign
    `.metadata`) as the CheckpointFormatError it is; any other failure as DCP raised it."""
    reader = RawStorageReader(checkpoint)
    # Read (and decode) the metadata first: DCP would turn a refusal into an AssertionError of its
    # own; every rank reads the same bytes, so every rank raises the same error here.
    reader.read_metadata()
    try:
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=JsonLoadPlanner(),
            process_group=process_group,
        )
    except CheckpointException as err:
        found = [exc for exc, _trace in err.failures.values()]
        if found and all(isinstance(exc, ShardCorruptError) for exc in found):
            raise ShardCorruptError([p for exc in found for p in exc.problems]) from err
        formats = [exc for exc in found if isinstance(exc, metadata_json.CheckpointFormatError)]
        if formats:
            raise formats[0] from err
        raise
