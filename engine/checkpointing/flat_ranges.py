"""A rank's flat ranges of a global tensor, as torch.distributed.checkpoint (DCP) entries.

Data parallelism's buckets give each rank arbitrary flat element ranges of a parameter (its
shard of the optimizer state, of the gradient, under ZeRO-3 of the parameter itself). A
checkpoint stores every tensor with its global shape (state.py), so another layout can read
exactly the slices it needs; DCP describes a rank's part of a tensor as rectangular boxes
(offsets and sizes in the global tensor). A flat range of a row-major tensor is a union of a few
such boxes, each contiguous in the range's memory: a partial innermost row, a block of whole
rows, and so on up the dimensions (`boxes`: at most 2 x ndim - 1). `FlatRanges` hands DCP those
boxes as views of the rank's own flat tensors: a save writes them and a load reads straight into
them, with no parameter-shaped assembly and no collective; the checkpoint's tensors are the same
global tensors (same keys, shapes and values) whatever the sharding level that wrote them.

Tensor parallelism is the outer layer: a rank's TP piece of a parameter is itself a box of the
global tensor, and a parameter made of `tp_stride` independently split chunks (SwiGLU's gate|up)
is stored as one key per chunk (`name#k`, state.py); `flat_range_entries` maps the local boxes
through both.

FlatRanges is a tensor subclass without storage of its own (DCP's checkpointable protocol:
`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`): any other use of it
as a tensor raises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from engine.parallel_placement import ParamPlacement

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, flat start), local coordinates


def boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """The flat range [lo, hi) of a row-major tensor of `shape` as boxes, in order, each
    contiguous in memory: (offsets, sizes, flat index of its first element)."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,) * len(shape), (hi - lo,) * len(shape), lo)]
    inner = math.prod(shape[1:])
    out: list[Box] = []

    def row(r: int, a: int, b: int) -> None:  # elements [a, b) of row r, a partial row
        for offsets, sizes, start in boxes(shape[1:], a, b):
            out.append(((r, *offsets), (1, *sizes), r * inner + start))

    if lo % inner:
        r = lo // inner
        end = min(hi, (r + 1) * inner)
        row(r, lo - r * inner, end - r * inner)
        lo = end
    if hi // inner > lo // inner and lo < hi:
        r0, r1 = lo // inner, hi // inner
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner))
        lo = r1 * inner
    if lo < hi:
        r = lo // inner
        row(r, 0, hi - r * inner)
    return out


class FlatRanges(torch.Tensor):
    """A global tensor of `shape` of which this rank holds `pieces`: (global offsets, a view of
    the rank's memory with the box's sizes, the index of the source it views). `sources`: the
    flat tensors the pieces are views of, as (lo, hi, tensor) in the local parameter's flat
    coordinates (the async save copies them to host memory, `with_sources`)."""

    @staticmethod
    def __new__(cls, shape, dtype, pieces, sources):
        # On the device of the memory it views: DCP treats a meta tensor as one to allocate.
        device = sources[0][2].device if sources else torch.device("cpu")
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        out.pieces = [(torch.Size(off), t, j) for off, t, j in pieces]
        out.sources = list(sources)
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.clone.default, torch.ops.aten.detach.default) and len(args) == 1:
            this = args[0]
            copy = func is torch.ops.aten.clone.default
            return this.with_sources([(lo, hi, t.clone() if copy else t) for lo, hi, t in this.sources])
        raise TypeError(f"FlatRanges is a checkpoint entry only: {func} is not supported on it")

    def local_values(self) -> torch.Tensor:
        """This rank's pieces, flattened one after the other (for comparisons in tests)."""
        flat = [t.reshape(-1) for _, t, _ in self.pieces]
        return torch.cat(flat) if flat else torch.zeros(0, dtype=self.dtype)

    def copy_from(self, other: FlatRanges) -> None:
        """Copy `other`'s pieces (the same boxes) into this one's memory."""
        if [o for o, _, _ in self.pieces] != [o for o, _, _ in other.pieces]:
            raise ValueError("FlatRanges.copy_from needs the same boxes on both sides")
        with torch.no_grad():
            for (_, dst, _), (_, src, _) in zip(self.pieces, other.pieces, strict=True):
                dst.copy_(src)

    def __repr__(self) -> str:  # the default repr would compute on the tensor
        return f"FlatRanges(shape={tuple(self.shape)}, dtype={self.dtype}, pieces={len(self.pieces)})"

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.shape),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
            for offsets, t, _ in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=t.shape) for offsets, t, _ in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, t, _ in self.pieces:
            if offsets == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no piece at offset {tuple(index.offset)}")

    def with_sources(self, sources: list[tuple[int, int, torch.Tensor]]) -> FlatRanges:
        """The same boxes over other flat tensors of the same ranges (a host copy)."""
        pieces = []
        for offsets, t, j in self.pieces:
            old, new = self.sources[j][2], sources[j][2]
            at = new.storage_offset() + t.storage_offset() - old.storage_offset()
            pieces.append((offsets, new.as_strided(t.shape, t.stride(), at), j))
        return FlatRanges(self.shape, self.dtype, pieces, sources)


def flat_range_entries(
    key: str,
    placement: ParamPlacement,
    local_shape: Sequence[int],
    dtype: torch.dtype,
    ranges: Sequence[tuple[int, int, torch.Tensor]],
    tp_rank: int,
    tp_world: int,
) -> dict[str, FlatRanges]:
    """{key (or key#k per strided chunk): FlatRanges} for `ranges`: (lo, hi, flat tensor of
    hi - lo elements) of this rank's local (TP) piece of a parameter of `local_shape`."""
    local_shape = tuple(local_shape)
    if not local_shape:  # a 0-d parameter: its one element
        pieces0 = [((), flat.view(()), j) for j, (lo, hi, flat) in enumerate(ranges) if hi > lo]
        return {key: FlatRanges((), dtype, pieces0, ranges)}
    dim, stride = placement.tp_dim, placement.tp_stride
    if dim is None:
        dim, stride, tp_rank, tp_world = 0, 1, 0, 1
    chunk = local_shape[dim] // stride  # a strided chunk's extent along dim, locally
    names = [f"{key}#{k}" for k in range(stride)] if stride > 1 else [key]
    global_shape = list(local_shape)
    global_shape[dim] = chunk * tp_world
    pieces: dict[str, list] = {name: [] for name in names}
    for j, (lo, hi, flat) in enumerate(ranges):
        for offsets, sizes, start in boxes(local_shape, lo, hi):
            view = flat[start - lo : start - lo + math.prod(sizes)].view(sizes)
            a, n = offsets[dim], sizes[dim]
            for k in range(a // chunk, (a + n - 1) // chunk + 1):  # the strided chunks it meets
                lo_k, hi_k = max(a, k * chunk), min(a + n, (k + 1) * chunk)
                where = list(offsets)
                where[dim] = lo_k - k * chunk + tp_rank * chunk
                pieces[names[k]].append((tuple(where), view.narrow(dim, lo_k - a, hi_k - lo_k), j))
    return {name: FlatRanges(tuple(global_shape), dtype, pieces[name], ranges) for name in names}
