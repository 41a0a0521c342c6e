"""A rank's flat ranges of a parameter as DCP boxes (engine/checkpointing/flat_ranges.py): the
boxes cover exactly the range, each is contiguous in the range's memory, and the TP / strided
mapping puts every element at its place in the global tensors."""

from __future__ import annotations

import math

import pytest
import torch

from engine.checkpointing.flat_ranges import FlatRanges, boxes, flat_range_entries
from engine.parallel_placement import ParamPlacement


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (4, 1, 3, 2)])
def test_boxes_cover_each_flat_range_exactly_and_contiguously(shape):
    n = math.prod(shape)
    whole = torch.arange(n).view(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            covered = torch.zeros(shape, dtype=torch.long)
            for offsets, sizes, start in boxes(shape, lo, hi):
                where = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                assert torch.equal(whole[where].reshape(-1), torch.arange(start, start + math.prod(sizes)))
                covered[where] += 1
            assert covered.view(-1)[lo:hi].eq(1).all() and int(covered.sum()) == hi - lo
            assert len(boxes(shape, lo, hi)) <= 2 * len(shape) - 1


@pytest.mark.parametrize("tp_world", [1, 2])
def test_strided_tp_pieces_land_in_their_chunk_of_the_global_tensor(tp_world):
    """SwiGLU's gate|up: global [2 R W, C] stored as two keys [R W, C]; rank r's local piece is
    its rows of gate then its rows of up."""
    rows, cols = 3, 4
    glob = torch.arange(2 * rows * tp_world * cols, dtype=torch.float32).view(2 * rows * tp_world, cols)
    gate, up = glob[: rows * tp_world], glob[rows * tp_world :]
    placement = ParamPlacement(shape=tuple(glob.shape), tp_dim=0, tp_stride=2)
    for rank in range(tp_world):
        local = torch.cat([gate[rank * rows : (rank + 1) * rows], up[rank * rows : (rank + 1) * rows]])
        for lo, hi in [(0, local.numel()), (5, 19), (13, 14)]:
            flat = local.view(-1)[lo:hi].clone()
            entries = flat_range_entries("w", placement, local.shape, flat.dtype, [(lo, hi, flat)], rank, tp_world)
            assert set(entries) == {"w#0", "w#1"}
            seen = 0
            for key, target in zip(("w#0", "w#1"), (gate, up), strict=True):
                assert tuple(entries[key].shape) == tuple(target.shape)
                for offsets, piece, _ in entries[key].pieces:
                    where = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape, strict=True))
                    assert torch.equal(target[where], piece)
                    seen += piece.numel()
            assert seen == hi - lo


def test_flat_ranges_is_only_a_checkpoint_entry():
    flat = torch.arange(6.0)
    entry = flat_range_entries("w", ParamPlacement(shape=(2, 3)), (2, 3), flat.dtype, [(0, 6, flat)], 0, 1)["w"]
    copy = entry.clone()
    flat.zero_()
    assert isinstance(copy, FlatRanges) and copy.local_values().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    entry.copy_from(copy)
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(TypeError, match="checkpoint entry only"):
        entry.sum()
