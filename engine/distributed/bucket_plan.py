"""Where each parameter's gradient (and, when sharded, its value) sits in DataParallel's flat
buffers, and which slice of each bucket each rank owns: a pure function of the parameters' sizes
and placements, the bucket size and the group sizes. No process group, no tensor: DataParallel
allocates what the plan says, the tests check the plan's invariants on any input, and a reader
(a checkpoint, a memory estimate) can ask what a layout holds without building it.

The rules the plan follows (what data_parallel.py always did):
- Parameters are taken in reverse registration order, which approximates the order backward
  produces their gradients, so the first bucket is complete first and its reduction overlaps
  the rest of backward. A bucket closes once it holds at least `bucket_size` elements.
- Dense parameters and MoE experts never share a bucket: experts are reduced and sharded over
  the expert data-parallel group (`expert_world` ranks), dense ones over the data-parallel (or
  HSDP shard) group (`world` ranks). Dense buckets come first in the buffer, then the experts'.
- A tied embedding (kept equal across pipeline stages) gets a bucket of its own, so that its
  shard ranges are the same on the first and the last stage and their gradients can be summed
  shard by shard.
- Each bucket is padded at its end to a multiple of its group's size; rank r of the group owns
  the r-th of the equal slices (its shard). No other alignment.
- With parameters sharded (ZeRO-3, `units` given) a bucket never spans two units (a unit is
  gathered whole): units are planned last layer first, then the root (the model's parameters
  outside the layers, unit -1); inside a unit, the experts' buckets first, then the dense ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROOT_UNIT = -1


@dataclass(frozen=True)
class ParamSlot:
    """What the planner needs of one parameter: its size and the placement facts that decide
    its bucket (`unit`: its layer's index when parameters are sharded by unit; None: the root)."""

    numel: int
    expert: bool = False
    tied: bool = False
    unit: int | None = None


@dataclass(frozen=True)
class Segment:
    """Parameter `param` (an index into the planner's input) at `offset` in the whole buffer."""

    param: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Owned:
    """Elements [lo, hi) of parameter `param` are this rank's: they sit at `shard_offset` in its
    shard of bucket `bucket`."""

    bucket: int
    param: int
    lo: int
    hi: int
    shard_offset: int


@dataclass(frozen=True)
class BucketPlan:
    offset: int  # in the whole (unsharded) buffer
    numel: int  # padded to a multiple of `world`
    world: int  # the ranks it is reduced and sharded over
    expert: bool
    unit: int | None  # None when not planned by unit; ROOT_UNIT for the root
    segments: tuple[Segment, ...]

    @property
    def padding(self) -> int:
        return self.numel - sum(s.numel for s in self.segments)

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Rank `rank`'s slice of the bucket, as offsets into the bucket."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def owned(self, index: int, rank: int) -> list[Owned]:
        """What of each parameter falls in rank `rank`'s shard (this bucket is number `index`)."""
        lo_b, hi_b = (self.offset + x for x in self.shard_range(rank))
        out = []
        for s in self.segments:
            lo, hi = max(s.offset, lo_b), min(s.offset + s.numel, hi_b)
            if lo < hi:
                out.append(Owned(index, s.param, lo - s.offset, hi - s.offset, lo - lo_b))
        return out


@dataclass(frozen=True)
class BucketLayout:
    buckets: tuple[BucketPlan, ...]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    def owned(self, rank: int, expert_rank: int, sharded: bool) -> list[Owned]:
        """Every (parameter, range) this rank owns, in bucket order: the slices of its shards when
        `sharded` (each bucket cut over its own group: `rank` in the dense one, `expert_rank` in
        the expert one), otherwise every parameter whole."""
        out = []
        for i, b in enumerate(self.buckets):
            if sharded:
                out.extend(b.owned(i, expert_rank if b.expert else rank))
            else:
                out.extend(Owned(i, s.param, 0, s.numel, 0) for s in b.segments)
        return out


def plan_buckets(
    params: Sequence[ParamSlot], bucket_size: int, *, world: int, expert_world: int = 1, units: int | None = None
) -> BucketLayout:
    """The buckets for `params` (in registration order). `units`: the number of layer units when
    parameters are sharded by unit (ZeRO-3), else None. See the module docstring for the rules."""
    if world < 1 or expert_world < 1:
        raise ValueError(f"group sizes must be >= 1, not {world} and {expert_world}")
    buckets: list[BucketPlan] = []
    offset = 0

    def fill(indices: list[int], expert: bool, unit: int | None) -> None:
        nonlocal offset
        size = expert_world if expert else world

        def close(group: list[int]) -> None:
            nonlocal offset
            if not group:
                return
            segments, at = [], offset
            for i in group:
                segments.append(Segment(i, at, params[i].numel))
                at += params[i].numel
            padded = -(-(at - offset) // size) * size
            buckets.append(BucketPlan(offset, padded, size, expert, unit, tuple(segments)))
            offset += padded

        current: list[int] = []
        for i in reversed(indices):
            if params[i].tied:
                close(current)
                current = []
                close([i])
                continue
            current.append(i)
            if sum(params[j].numel for j in current) >= bucket_size:
                close(current)
                current = []
        close(current)

    everything = range(len(params))
    if units is None:
        fill([i for i in everything if not params[i].expert], False, None)
        fill([i for i in everything if params[i].expert], True, None)
    else:
        for unit in [*reversed(range(units)), ROOT_UNIT]:
            mine = [i for i in everything if (params[i].unit if params[i].unit is not None else ROOT_UNIT) == unit]
            fill([i for i in mine if params[i].expert], True, unit)
            fill([i for i in mine if not params[i].expert], False, unit)
    return BucketLayout(tuple(buckets))
