"""Where checkpoint files live: a local directory or an S3 bucket, behind one small interface.

`torch.distributed.checkpoint` (DCP) plans which bytes each rank writes and reads; `raw_io.py`
moves those bytes through this interface and the commit protocol (`commit.py`) publishes them.
DCP's own FileSystemWriter only knows POSIX paths and fsspec's S3 layer would add a dependency
without giving us what a training job needs from object storage, so the few operations used are
written here: the interface in this module, the backends in `local_storage.py` and
`s3_storage.py`, and `open_storage` in `backends.py` to pick one from a URI (the factory sits
above both backends, so neither of them imports it back).

- Keys are '/'-separated strings relative to the storage root (`"job/iter_0000010/__0_0.distcp"`).
  `list` and `delete_prefix` treat the prefix as a folder: `"job"` covers `"job/..."` but never
  `"job2/..."`, so deleting one job's checkpoints cannot touch a sibling job's.
- Every write is all-or-nothing as seen by a reader. This is what lets `commit.py` publish a
  manifest last and have readers trust that a visible manifest means a complete checkpoint.
- `open_write` streams an object front to back from memory (a checkpoint's tensors), and
  `read_into` fills caller-given buffers (the tensors a load fills) with a byte range: shards go
  between memory and storage without a staging file, a whole-file temp copy or a second pass.
- A missing key raises `FileNotFoundError` on both backends; a read past the end, `EOFError`.
- Credentials are never logged or put in `repr`/`uri`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from pathlib import Path

MiB = 1024 * 1024

# Anything exposing the buffer protocol as contiguous bytes: bytes, bytearray, a memoryview of
# a tensor's memory (see raw_io._bytes_of).
Buffer = bytes | bytearray | memoryview


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """Normalise a key ('/'-separated, relative); refuse ones that could escape the root."""
    if not isinstance(key, str):
        raise TypeError(f"storage key must be a str, got {type(key).__name__}")
    stripped = key.strip("/")
    if not stripped:
        if allow_empty:
            return ""
        raise ValueError(f"empty storage key {key!r}")
    parts = stripped.split("/")
    bad = [p for p in parts if p in ("", ".", "..") or "\\" in p or "\0" in p]
    if bad:
        raise ValueError(f"invalid storage key {key!r}: segments must be non-empty and not '.' or '..'")
    return stripped


class WriteStream(abc.ABC):
    """An object written front to back by one thread; visible under its key only after `commit`.

    As a context manager it commits when the block ends normally and aborts (nothing becomes
    visible, temporary data is removed) when the block raises.
    """

    size: int = 0  # bytes written so far

    @abc.abstractmethod
    def write(self, data: Buffer) -> None:
        """Append `data` (copied or sent before this returns: the caller may reuse its memory)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the object visible under its key, atomically; on failure, abort and raise."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop what was written; no error if it is already gone."""

    def __enter__(self) -> WriteStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def byte_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    return [memoryview(b).cast("B") for b in buffers]


def byte_window(views: list[memoryview], start: int, length: int) -> list[memoryview]:
    """The slices of `views`, taken as one run of bytes, that cover [start, start + length)."""
    out = []
    for v in views:
        if length <= 0:
            break
        if start >= len(v):
            start -= len(v)
            continue
        take = min(len(v) - start, length)
        out.append(v[start : start + take])
        length -= take
        start = 0
    return out


class Storage(abc.ABC):
    """A flat key space of immutable-once-written blobs, as the checkpoint commit protocol needs it."""

    uri: str
    concurrency: int = 4  # how many reads are worth having in flight at once

    @abc.abstractmethod
    def put_file(self, local_path: Path, key: str) -> None:
        """Upload a local file to `key`, atomically (readers see the old object or the whole new one)."""

    @abc.abstractmethod
    def get_file(self, key: str, local_path: Path) -> None:
        """Download `key` to `local_path` (parent folders created), atomically."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write `data` to `key`, atomically."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read the whole of `key`; FileNotFoundError if absent."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored at exactly `key`."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """All keys under the folder `prefix` ("" = everything), recursively, sorted, as full keys."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object at `key`; no error if it is absent."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under the folder `prefix` ("" = everything under this storage's root)."""

    @abc.abstractmethod
    def local_path(self, key: str) -> Path | None:
        """Where `key` lives on this machine's file system, or None for remote storage."""

    @abc.abstractmethod
    def open_write(self, key: str) -> WriteStream:
        """A stream whose bytes become the object at `key` when it is committed."""

    @abc.abstractmethod
    def read_into(self, key: str, offset: int, buffers: Sequence[Buffer]) -> None:
        """Fill `buffers`, in order, with the bytes of `key` from `offset` on (one request or a few
        parallel ones, however many buffers). FileNotFoundError if `key` is absent, EOFError if
        it ends before the buffers are full."""

    @abc.abstractmethod
    def sizes(self, prefix: str) -> dict[str, int]:
        """{key: size in bytes} for every key under the folder `prefix`, from one listing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
