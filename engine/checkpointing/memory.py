"""In-memory checkpoints: one rank's checkpoint parts as one checksummed block of bytes.

The persistent checkpoint (checkpointer.py) is global: shards keyed by global coordinates, so
any layout can load it. Recovering a lost rank in seconds needs something cheaper, written every
few steps: the same parts (`Trainer.checkpoint_parts()`: model, optimizer, RNG, data position,
schedule, loss scaler, rerun state) as this rank holds them, copied to host memory, and loadable
only by the same rank of the same layout (a resized group falls back to the persistent
checkpoint, which reshards). Where the bytes are kept (a per-node holder that outlives the rank's
process, replicas on other nodes) is the launcher's business: the engine only makes and takes
bytes, and knows nothing of Ray.

`capture(parts, ...)` runs in the training thread and costs the host copy: every part's
state_dict() (the same collectives a persistent save makes: the ZeRO-1 assembly, the rerun
state gather), tensors copied (DTensors as their local shard) into one host buffer, the rest
kept as JSON meta exactly as the manifest would hold it. The buffer is laid out as the framed
block from the start (a magic line, the CRC-32 frame, a JSON header: job, rank, world size,
layout, iteration, meta, where each tensor lies; then the tensor bytes, 64-byte aligned), so
the copy is the only pass over the state the training thread makes; `HostSnapshot.seal()` (any
thread) writes the CRC-32 (the persistent shards' checksum) over header and payload into the
frame and returns the block itself, no copy. `parse(blob, ...)` refuses a blob whose checksum, job, rank, world size or
layout does not match (`SnapshotError`), so a corrupted or foreign shard is never loaded; the
launcher decides which iteration is current (a stale one is never offered). `restore(parts, snap)`
loads it like a persistent resume of the same layout: `load_target` where a part plans its load,
tensors copied in, meta values from the snapshot, then every `load_state_dict`.
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from engine.checkpointing.stateful import PlansItsLoad, SavedCheckpoint, Stateful

MAGIC = b"ELASTRON-SNAPSHOT-1\n"
_FRAME = struct.Struct("<QI")  # header length, CRC-32 of header + payload
_ALIGN = 64


class SnapshotError(ValueError):
    """An in-memory snapshot that must not be loaded: corrupted, truncated, or not this rank's."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class HostSnapshot:
    """One rank's checkpoint parts in host memory (see the module docstring)."""

    job: str
    rank: int
    world_size: int
    layout: str
    iteration: int
    meta: dict[str, dict[str, Any]]  # part -> its non-tensor values
    index: list[list[Any]]  # [part, key, dtype, shape, offset, nbytes] per tensor
    payload: bytearray | memoryview = field(repr=False)
    # The whole framed block the payload ends (captured snapshots only; its CRC set by seal()).
    block: memoryview | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    def header(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "layout": self.layout,
            "iteration": self.iteration,
            "meta": self.meta,
            "tensors": self.index,
        }

    def seal(self) -> memoryview:
        """The framed block with its CRC-32 written in: a view of the capture buffer (valid until
        the buffer is reused for the next capture)."""
        if self.block is None:
            raise ValueError("only a captured snapshot can be sealed")
        start = len(MAGIC) + _FRAME.size
        header_len = len(self.block) - len(self.payload) - start
        crc = zlib.crc32(self.payload, zlib.crc32(self.block[start : start + header_len]))
        _FRAME.pack_into(self.block, len(MAGIC), header_len, crc)
        return self.block

    def to_bytes(self) -> bytes:
        """The framed, checksummed block as bytes of its own (a copy)."""
        return bytes(self.seal())

    def tensor(self, part: str, key: str) -> torch.Tensor:
        for p, k, dtype, shape, offset, nbytes in self.index:
            if (p, k) == (part, key):
                return _view(self.payload, dtype, shape, offset, nbytes)
        raise KeyError(f"{part}/{key}")


def _view(payload, dtype: str, shape: list[int], offset: int, nbytes: int) -> torch.Tensor:
    raw = (
        torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset)
        if nbytes
        else torch.empty(0, dtype=torch.uint8)
    )
    return raw.view(getattr(torch, dtype)).reshape(shape)


def capture(
    parts: Mapping[str, Stateful],
    *,
    job: str,
    rank: int,
    world_size: int,
    layout: str,
    buffer: bytearray | None = None,
) -> HostSnapshot:
    """Every part's state, this rank's tensors copied into host memory (`buffer` when it is big
    enough: reusing touched pages is several times faster than fresh ones). A collective where
    the parts' state_dict() are (every rank captures at the same iteration)."""
    states = {name: part.state_dict() for name, part in parts.items()}
    index: list[list[Any]] = []
    meta: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, state in states.items():
        meta[name] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                local = _local(value)
                nbytes = local.numel() * local.element_size()
                index.append(
                    [name, key, str(local.dtype).removeprefix("torch."), list(local.shape), offset, nbytes]
                )
                offset += -(-nbytes // _ALIGN) * _ALIGN
            else:
                meta[name][key] = value
    # Meta as the manifest would hold it: plain JSON, so what comes back is what a resume gets.
    meta = json.loads(json.dumps(meta))
    iterations = [m["iteration"] for m in meta.values() if isinstance(m.get("iteration"), int)]
    if len(iterations) != 1:
        raise ValueError("no checkpoint part gives the iteration that names the snapshot (DataPosition does)")
    snap = HostSnapshot(job, rank, world_size, layout, iterations[0], meta, index, b"")
    header = json.dumps(snap.header(), separators=(",", ":")).encode()
    start = len(MAGIC) + _FRAME.size
    header += b" " * (-(start + len(header)) % _ALIGN)  # JSON ignores it; the payload is aligned
    total = start + len(header) + offset
    if buffer is None or len(buffer) < total:
        buffer = bytearray(total)
    block = memoryview(buffer)[:total]
    block[: len(MAGIC)] = MAGIC
    block[start : start + len(header)] = header
    snap.block, snap.payload = block, block[start + len(header) :]
    tensors = iter(v for state in states.values() for v in state.values() if isinstance(v, torch.Tensor))
    for (_, _, dtype, shape, off, nbytes), value in zip(index, tensors, strict=True):
        if nbytes:
            _view(snap.payload, dtype, shape, off, nbytes).copy_(_local(value).detach())
    return snap


def parse(
    blob: bytes | bytearray | memoryview, *, job: str, rank: int, world_size: int, layout: str
) -> HostSnapshot:
    """The snapshot in `blob`, checked: its CRC-32 over header and payload, and that it is this
    job's, this rank's, of this world size and layout. Raises SnapshotError naming what is wrong."""
    view = memoryview(blob)
    head = len(MAGIC) + _FRAME.size
    if len(view) < head or bytes(view[: len(MAGIC)]) != MAGIC:
        raise SnapshotError("in-memory snapshot: not a snapshot (bad magic)")
    header_len, crc = _FRAME.unpack(view[len(MAGIC) : head])
    header_bytes, payload = view[head : head + header_len], view[head + header_len :]
    if len(header_bytes) != header_len or zlib.crc32(payload, zlib.crc32(header_bytes)) != crc:
        raise SnapshotError("in-memory snapshot: checksum mismatch (corrupted or truncated); it is not used")
    h = json.loads(bytes(header_bytes))
    want = {"job": job, "rank": rank, "world_size": world_size, "layout": layout}
    wrong = [f"{k} {h.get(k)!r} (this rank: {v!r})" for k, v in want.items() if h.get(k) != v]
    if wrong:
        raise SnapshotError(
            f"in-memory snapshot of iteration {h.get('iteration')} is not this rank's: {', '.join(wrong)}"
        )
    return HostSnapshot(
        h["job"], h["rank"], h["world_size"], h["layout"], h["iteration"], h["meta"], h["tensors"], payload
    )


@torch.no_grad()
def restore(parts: Mapping[str, Stateful], snap: HostSnapshot) -> int:
    """Load `snap` (from `parse`) into `parts`, as a resume of the same layout does; returns its
    iteration. Every part must find its state in the snapshot and vice versa, checked before
    anything is loaded; parts get their state only once every tensor is copied in."""
    if set(snap.meta) != set(parts):
        raise SnapshotError(
            f"in-memory snapshot of iteration {snap.iteration} holds parts {sorted(snap.meta)}, "
            f"this job has {sorted(parts)}"
        )
    flat_meta = {k: v for m in snap.meta.values() for k, v in m.items()}
    saved = SavedCheckpoint(snap.iteration, flat_meta, same_layout=True)
    targets = {
        name: part.load_target(saved) if isinstance(part, PlansItsLoad) else part.state_dict()
        for name, part in parts.items()
    }
    stored = {(p, k): (dtype, shape, off, n) for p, k, dtype, shape, off, n in snap.index}
    wanted = {(name, k) for name, t in targets.items() for k, v in t.items() if isinstance(v, torch.Tensor)}
    if wanted != stored.keys():
        missing = ", ".join(f"{p}/{k}" for p, k in sorted(wanted - stored.keys()))
        extra = ", ".join(f"{p}/{k}" for p, k in sorted(stored.keys() - wanted))
        raise SnapshotError(
            f"in-memory snapshot of iteration {snap.iteration} does not match this job's parts"
            + (f"; lacks {missing}" if missing else "")
            + (f"; holds {extra} that no part restores" if extra else "")
        )
    for (name, key), (dtype, shape, _, _) in stored.items():
        dst = _local(targets[name][key])
        if list(dst.shape) != list(shape) or str(dst.dtype).removeprefix("torch.") != dtype:
            raise SnapshotError(
                f"in-memory snapshot: {name}/{key} is {dtype} {list(shape)}, "
                f"this rank has {dst.dtype} {list(dst.shape)}"
            )
    with warnings.catch_warnings():  # a read-only blob: only read from
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for (name, key), (dtype, shape, off, n) in stored.items():
            _local(targets[name][key]).copy_(_view(snap.payload, dtype, shape, off, n))
    for name, part in parts.items():
        part.load_state_dict(
            {
                k: v if isinstance(v, torch.Tensor) else snap.meta[name].get(k, v)
                for k, v in targets[name].items()
            }
        )
    return snap.iteration
