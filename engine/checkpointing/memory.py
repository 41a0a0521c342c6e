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
state_dict() (whatever that costs the part: the Trainer's snapshot parts, local_shards.py, hand
over what the rank holds, with no collective), tensors copied (DTensors as their local shard)
into one host buffer, the rest kept as JSON meta exactly as the manifest would hold it. A tensor
that n data-parallel replicas hold bit for bit (`SharesReplicas`: the weights; Adam's state
without the distributed optimizer) is copied only 1/n by each of them: the tensors one replica
group shares are a stream of bytes cut into n slices, one per rank, and `restore` gathers the
slices back over that group. Every rank's snapshot of an iteration is needed to restore any of
them, which recovery asks anyway (the ranks restore together or not at all), and the per-step
copy and checksum shrink by the DP size. The buffer is laid out as the framed block from the
start (a magic line, the checksum frame, a JSON header: job, rank, world size, layout,
iteration, meta, where each tensor or slice lies; then the bytes, 64-byte aligned), so the copy
is the only pass over the state the training thread makes; `HostSnapshot.seal()` (any thread)
writes the XXH3-64 checksum of header and payload into the frame and returns the block itself, no copy. `parse(blob, ...)` refuses a blob whose checksum, job, rank, world size or
layout does not match (`SnapshotError`), so a corrupted or foreign shard is never loaded; the
launcher decides which iteration is current (a stale one is never offered). `restore(parts, snap)`
loads it with the persistent resume's own routine (restore.py), as a resume of the same layout:
`load_target` where a part plans its load, tensors copied in, meta values from the snapshot, then
every `load_state_dict`.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.tensor import DTensor

from engine import device
from engine.checkpointing.restore import restore_parts
from engine.checkpointing.stateful import SavedCheckpoint, Stateful

MAGIC = b"ELASTRON-SNAPSHOT-2\n"
# Header length, XXH3-64 of header + payload. Not the persistent shards' CRC-32: a snapshot is
# checksummed every step on the ranks' own cores, and XXH3 takes a fifth of CRC-32's time here
# (20 MB: 0.6 ms vs 2.9 ms) and is a 64-bit check.
_FRAME = struct.Struct("<QQ")
_ALIGN = 64
# Bytes per rank gathered at once when a snapshot's shared tensors are put back together: the
# gather buffer is the group size times this, on the device.
GATHER_WINDOW = 64 << 20


class SnapshotError(ValueError):
    """An in-memory snapshot that must not be loaded: corrupted, truncated, or not this rank's."""


def _checksum(header, payload) -> int:
    h = xxhash.xxh3_64(header)
    h.update(payload)
    return h.intdigest()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat uint8 tensor (a view when `t` is contiguous, else a copy)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _stream_name(group: dist.ProcessGroup) -> str:
    """A replica group by its global ranks: the same name on every rank and in every process."""
    return ",".join(str(r) for r in dist.get_process_group_ranks(group))


def _share(total: int, size: int, index: int) -> tuple[int, int, int]:
    """(per-rank length, lo, hi): the `index`-th of `size` aligned slices of `total` bytes."""
    per = -(-total // size)
    per = -(-per // _ALIGN) * _ALIGN
    lo = min(index * per, total)
    return per, lo, min(lo + per, total)


@dataclass
class HostSnapshot:
    """One rank's checkpoint parts in host memory (see the module docstring)."""

    job: str
    rank: int
    world_size: int
    layout: str
    iteration: int
    meta: dict[str, dict[str, Any]]  # part -> its non-tensor values
    # [part, key, dtype, shape, offset, nbytes, stream] per tensor: `stream` None, the tensor is
    # whole in the payload at `offset`; else it lies at `offset` in the named stream (the tensors
    # a replica group shares, one after the other), of which this rank holds one slice.
    index: list[list[Any]]
    payload: bytearray | memoryview = field(repr=False)
    # stream (the group's ranks, "0,1") -> {"total": its bytes, "lo", "hi": this rank's slice of
    # them, "offset": where that slice lies in the payload}
    streams: dict[str, dict[str, int]] = field(default_factory=dict)
    # The whole framed block the payload ends (captured snapshots only; its checksum set by seal()).
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
            "streams": self.streams,
        }

    def seal(self) -> memoryview:
        """The framed block with its checksum written in: a view of the capture buffer (valid until
        the buffer is reused for the next capture)."""
        if self.block is None:
            raise ValueError("only a captured snapshot can be sealed")
        start = len(MAGIC) + _FRAME.size
        header_len = len(self.block) - len(self.payload) - start
        digest = _checksum(self.block[start : start + header_len], self.payload)
        _FRAME.pack_into(self.block, len(MAGIC), header_len, digest)
        return self.block

    def to_bytes(self) -> bytes:
        """The framed, checksummed block as bytes of its own (a copy)."""
        return bytes(self.seal())


def _view(payload, dtype: str, shape: list[int], offset: int, nbytes: int) -> torch.Tensor:
    return _raw(payload, offset, nbytes).view(getattr(torch, dtype)).reshape(shape)


def _raw(payload, offset: int, nbytes: int) -> torch.Tensor:
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset)


def _overlaps(rows: list[list[Any]], lo: int, hi: int):
    """(row, a, b) for every stream row whose bytes [offset, offset + nbytes) meet [lo, hi):
    [a, b) is the common part, in stream coordinates."""
    for row in rows:
        off, nbytes = row[4], row[5]
        a, b = max(lo, off), min(hi, off + nbytes)
        if a < b:
            yield row, a, b


def _replica_groups(parts: Mapping[str, Stateful], states: Mapping[str, Mapping[str, Any]]) -> dict:
    """(part, key) -> (stream name, process group): the ranks that hold that tensor bit for bit
    (SharesReplicas), when there are more than this one."""
    out, names = {}, {}
    for name, state in states.items():
        # SharesReplicas, by its method: a runtime Protocol check costs more than the rest here.
        replica_group = getattr(parts[name], "replica_group", None)
        if replica_group is None:
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                group = replica_group(key)
                if group is None:
                    continue
                if id(group) not in names:
                    names[id(group)] = _stream_name(group) if dist.get_world_size(group) > 1 else None
                if names[id(group)] is not None:
                    out[(name, key)] = names[id(group)], group
    return out


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
    enough: reusing touched pages is several times faster than fresh ones). A tensor n ranks
    hold alike (SharesReplicas: the data-parallel replicas) is kept 1/n here, the rest by its
    replicas: the tensors of one group form a stream of bytes cut into n slices, this rank's
    slice copied. A collective where the parts' state_dict() are (every rank captures at the
    same iteration); the slicing itself needs no communication."""
    states = {name: part.state_dict() for name, part in parts.items()}
    shared = _replica_groups(parts, states)
    index: list[list[Any]] = []
    meta: dict[str, dict[str, Any]] = {}
    groups: dict[str, dist.ProcessGroup] = {}
    stream_ends: dict[str, int] = {}
    offset = 0
    for name, state in states.items():
        meta[name] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                local = _local(value)
                nbytes = local.numel() * local.element_size()
                row = [
                    name,
                    key,
                    str(local.dtype).removeprefix("torch."),
                    list(local.shape),
                    offset,
                    nbytes,
                    None,
                ]
                if (name, key) not in shared:
                    offset += -(-nbytes // _ALIGN) * _ALIGN
                else:
                    stream, groups[stream] = shared[(name, key)]
                    row[4], row[6] = stream_ends.get(stream, 0), stream
                    stream_ends[stream] = row[4] + -(-nbytes // _ALIGN) * _ALIGN
                index.append(row)
            else:
                meta[name][key] = value
    streams = {}
    for stream, total in sorted(stream_ends.items()):
        group = groups[stream]
        _, lo, hi = _share(total, dist.get_world_size(group), dist.get_rank(group))
        streams[stream] = {"total": total, "lo": lo, "hi": hi, "offset": offset}
        offset += -(-(hi - lo) // _ALIGN) * _ALIGN
    # Meta as the manifest would hold it: plain JSON, so what comes back is what a resume gets.
    meta = json.loads(json.dumps(meta))
    iterations = [m["iteration"] for m in meta.values() if isinstance(m.get("iteration"), int)]
    if len(iterations) != 1:
        raise ValueError("no checkpoint part gives the iteration that names the snapshot (DataPosition does)")
    snap = HostSnapshot(job, rank, world_size, layout, iterations[0], meta, index, b"", streams)
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
    tensors = (v for state in states.values() for v in state.values() if isinstance(v, torch.Tensor))
    for (_, _, dtype, shape, off, nbytes, stream), value in zip(index, tensors, strict=True):
        if stream is None:
            if nbytes:
                _view(snap.payload, dtype, shape, off, nbytes).copy_(_local(value).detach())
            continue
        share = streams[stream]
        a, b = max(share["lo"], off), min(share["hi"], off + nbytes)
        if a < b:
            dst = share["offset"] + a - share["lo"]
            _raw(snap.payload, dst, b - a).copy_(_bytes_of(_local(value))[a - off : b - off])
    return snap


def parse(
    blob: bytes | bytearray | memoryview, *, job: str, rank: int, world_size: int, layout: str
) -> HostSnapshot:
    """The snapshot in `blob`, checked: its checksum over header and payload, and that it is this
    job's, this rank's, of this world size and layout. Raises SnapshotError naming what is wrong."""
    view = memoryview(blob)
    head = len(MAGIC) + _FRAME.size
    if len(view) < head or bytes(view[: len(MAGIC)]) != MAGIC:
        raise SnapshotError("in-memory snapshot: not a snapshot (bad magic)")
    header_len, digest = _FRAME.unpack(view[len(MAGIC) : head])
    header_bytes, payload = view[head : head + header_len], view[head + header_len :]
    if len(header_bytes) != header_len or _checksum(header_bytes, payload) != digest:
        raise SnapshotError("in-memory snapshot: checksum mismatch (corrupted or truncated); it is not used")
    try:  # JSON: data, never unpickled (issue 61)
        h = json.loads(bytes(header_bytes))
    except ValueError as err:
        raise SnapshotError(f"in-memory snapshot: its header is not JSON ({err}); it is not used") from None
    want = {"job": job, "rank": rank, "world_size": world_size, "layout": layout}
    wrong = [f"{k} {h.get(k)!r} (this rank: {v!r})" for k, v in want.items() if h.get(k) != v]
    if wrong:
        raise SnapshotError(
            f"in-memory snapshot of iteration {h.get('iteration')} is not this rank's: {', '.join(wrong)}"
        )
    return HostSnapshot(
        h["job"],
        h["rank"],
        h["world_size"],
        h["layout"],
        h["iteration"],
        h["meta"],
        h["tensors"],
        payload,
        h["streams"],
    )


@torch.no_grad()
def restore(parts: Mapping[str, Stateful], snap: HostSnapshot) -> int:
    """Load `snap` (from `parse`) into `parts`, as a resume of the same layout does (the same
    routine: restore.restore_parts); returns its iteration. Every part must find its state in the
    snapshot and vice versa, and every shared tensor the same replica group, checked before
    anything is loaded; parts get their state only once every tensor is copied in. A collective
    over each replica group (every rank of the job restores the same iteration): the slices its
    ranks kept are gathered back into whole tensors."""
    if set(snap.meta) != set(parts):
        raise SnapshotError(
            f"in-memory snapshot of iteration {snap.iteration} holds parts {sorted(snap.meta)}, "
            f"this job has {sorted(parts)}"
        )
    flat_meta = {k: v for m in snap.meta.values() for k, v in m.items()}
    saved = SavedCheckpoint(snap.iteration, flat_meta, same_layout=True)
    restore_parts(parts, saved, lambda targets: _load_tensors(parts, snap, targets), snap.meta)
    return snap.iteration


def _load_tensors(parts: Mapping[str, Stateful], snap: HostSnapshot, targets: dict[str, dict[str, Any]]) -> None:
    """Check `targets` against the snapshot (the same tensors, shapes, dtypes and replica groups;
    this rank's slices), then copy every tensor in and gather the shared ones over their groups."""
    stored = {(row[0], row[1]): row for row in snap.index}
    wanted = {(name, k) for name, t in targets.items() for k, v in t.items() if isinstance(v, torch.Tensor)}
    if wanted != stored.keys():
        missing = ", ".join(f"{p}/{k}" for p, k in sorted(wanted - stored.keys()))
        extra = ", ".join(f"{p}/{k}" for p, k in sorted(stored.keys() - wanted))
        raise SnapshotError(
            f"in-memory snapshot of iteration {snap.iteration} does not match this job's parts"
            + (f"; lacks {missing}" if missing else "")
            + (f"; holds {extra} that no part restores" if extra else "")
        )
    shared = _replica_groups(parts, targets)
    groups: dict[str, dist.ProcessGroup] = {}
    for (name, key), (_, _, dtype, shape, _, _, stream) in stored.items():
        dst = _local(targets[name][key])
        if list(dst.shape) != list(shape) or str(dst.dtype).removeprefix("torch.") != dtype:
            raise SnapshotError(
                f"in-memory snapshot: {name}/{key} is {dtype} {list(shape)}, "
                f"this rank has {dst.dtype} {list(dst.shape)}"
            )
        mine, group = shared.get((name, key), (None, None))
        if mine != stream:
            raise SnapshotError(
                f"in-memory snapshot: {name}/{key} was kept "
                + (f"in slices over ranks {stream}" if stream else "whole")
                + ", this job has it "
                + (f"on ranks {mine}" if mine else "on this rank alone")
            )
        if group is not None:
            # Gathered bytes land in the tensor's own memory: one block of it, or they are lost.
            if not dst.is_contiguous():
                raise SnapshotError(f"in-memory snapshot: {name}/{key} is shared but not contiguous here")
            groups[stream] = group
    for stream, share in snap.streams.items():  # checked here, before any rank starts gathering
        _, lo, hi = _share(share["total"], dist.get_world_size(groups[stream]), dist.get_rank(groups[stream]))
        if (lo, hi) != (share["lo"], share["hi"]):
            raise SnapshotError(
                f"in-memory snapshot: its slice of ranks {stream}'s tensors is not this rank's"
            )
    with warnings.catch_warnings():  # a read-only blob: only read from
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for (name, key), (_, _, dtype, shape, off, n, stream) in stored.items():
            if stream is None:
                _local(targets[name][key]).copy_(_view(snap.payload, dtype, shape, off, n))
        for stream in sorted(snap.streams):  # one order on every rank: no two groups wait on each other
            rows = [row for row in snap.index if row[6] == stream]
            _gather_stream(snap, stream, rows, targets, groups[stream])


def _gather_stream(
    snap: HostSnapshot, stream: str, rows: list[list[Any]], targets: dict, group: dist.ProcessGroup
) -> None:
    """Every rank of `group` contributes its slice of `stream`, in windows of GATHER_WINDOW
    bytes per rank, and copies the gathered bytes into the tensors they belong to."""
    share = snap.streams[stream]
    size, me = dist.get_world_size(group), dist.get_rank(group)
    per, lo, hi = _share(share["total"], size, me)
    where = device.current_device()  # the group's backend: NCCL gathers device memory
    flat = {(row[0], row[1]): _bytes_of(_local(targets[row[0]][row[1]])) for row in rows}  # views
    for w in range(0, per, GATHER_WINDOW):
        width = min(GATHER_WINDOW, per - w)
        mine = torch.zeros(width, dtype=torch.uint8, device=where)
        a, b = lo + w, min(lo + w + width, hi)
        if a < b:
            mine[: b - a].copy_(_raw(snap.payload, share["offset"] + w, b - a))
        out = torch.empty(size * width, dtype=torch.uint8, device=where)
        dist.all_gather(list(out.chunk(size)), mine, group=group)
        for j in range(size):
            start = j * per + w  # where rank j's window lies in the stream
            for row, a, b in _overlaps(rows, start, min(start + width, share["total"])):
                flat[row[0], row[1]][a - row[4] : b - row[4]].copy_(
                    out[j * width + a - start : j * width + b - start]
                )
