"""DCP storage writer/reader that store each tensor's raw bytes instead of a torch.save record.

torch's FileSystemWriter runs torch.save per tensor item and its reader torch.load's each one
and copies it again; on a 1.14 GiB checkpoint that made the save 3.6x and the load 6.8x slower
than writing/reading the same bytes (bench/checkpoint_io.py). Here a tensor item is its
contiguous bytes at (offset, length) in the rank's file, recorded in DCP's own metadata like
any storage item, so DCP still plans which slices each rank of any layout reads. A read goes
straight into the target tensor (`readinto`) when it wants a whole stored chunk, otherwise
into one buffer that is narrowed and copied.

Everything else (planning, deduplication, `.metadata`, the file naming __<rank>_<n>.distcp,
several files per rank written by parallel threads) is FileSystemWriter's/Reader's. The format
is named in the checkpoint manifest (`shard_format`), so a reader never guesses.

It leans on three private DCP names (`_split_by_size_and_type`, `_StorageInfo`,
`narrow_tensor_by_index`); the torch pin (< 2.14) keeps them stable, and the checkpoint tests
(resharding matrix, resume, corruption) fail loudly if an upgrade moves them.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _split_by_size_and_type, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

FORMAT = "raw-v1"


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, including bf16)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class RawFileSystemWriter(FileSystemWriter):
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        buckets = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]

        def write_file(number: int, items) -> list[WriteResult]:
            name = f"{prefix}{number}{DEFAULT_SUFFIX}"
            results = []
            with open(Path(self.path) / name, "wb") as stream:
                for item in items:
                    data = planner.resolve_data(item)
                    offset = stream.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                    else:
                        stream.write(_bytes_of(data.detach().cpu().contiguous()))
                    length = stream.tell() - offset
                    results.append(
                        WriteResult(
                            index=item.index,
                            size_in_bytes=length,
                            storage_data=_StorageInfo(name, offset, length),
                        )
                    )
                if self.sync_files:
                    stream.flush()
                    os.fsync(stream.fileno())
            return results

        with ThreadPoolExecutor(max_workers=max(1, len(buckets))) as pool:
            per_file = list(pool.map(write_file, range(len(buckets)), buckets))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for results in per_file for r in results])
        return fut


class RawFileSystemReader(FileSystemReader):
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            with open(Path(self.path) / relative_path, "rb") as stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    stream.seek(info.offset)
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(stream.read(info.length)))
                        continue
                    dtype, sizes = self._stored_chunk(req.storage_index)
                    target = planner.resolve_tensor(req).detach()
                    whole = tuple(req.lengths) == tuple(sizes) and not any(req.storage_offsets)
                    if (
                        whole
                        and target.is_contiguous()
                        and target.dtype == dtype
                        and target.device.type == "cpu"
                    ):
                        got = stream.readinto(_bytes_of(target))
                    else:
                        buf = torch.empty(sizes, dtype=dtype)
                        got = stream.readinto(_bytes_of(buf))
                        target.copy_(narrow_tensor_by_index(buf, req.storage_offsets, req.lengths))
                    if got != info.length:
                        raise OSError(
                            f"{relative_path}: short read of {req.storage_index.fqn} ({got} of {info.length} bytes)"
                        )
                    planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut
