"""DataParallel's state as checkpoints see it: a read-only view, so that the checkpoint parts
(engine/checkpointing/state.py, local_shards.py) need nothing of its buckets, strategies or flags.

A checkpoint needs three things of data parallelism:
- per parameter, which ranks hold it alike (to write one copy, or keep a 1/n slice of it in a
  snapshot), and over which ranks its optimizer state is split into disjoint flat ranges or
  held alike;
- the tensors it keeps that are not the parameters: under ZeRO-3 each bucket's persistent
  parameter shard, with the HSDP replicas that hold the same shard, and the flat range of each
  parameter this rank owns in them (what the persistent checkpoint saves and loads in place);
- a way to bring parameters up to date after the persistent values (shards, or the optimizer's
  masters) were replaced by a load; and, for tests and inspection, to make every parameter
  whole (a collective under ZeRO-3) and put whole values back into the shards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from engine.distributed.bucket import Bucket


class ViewedChunk(Protocol):
    """What `CheckpointView.of` reads of a data-parallel chunk (DataParallel, data_parallel.py):
    its buckets, what its level shards, the flat ranges this rank owns and the assembly steps."""

    buckets: Sequence[Bucket]

    @property
    def shard(self) -> bool: ...

    @property
    def shard_params(self) -> bool: ...

    def param_shard_ranges(self) -> list[tuple[torch.Tensor, int, int]]: ...

    def param_views(self) -> list[torch.Tensor]: ...

    def gather_all_params(self) -> None: ...

    def params_loaded(self) -> None: ...

    def gather_params(self) -> None: ...


@dataclass(frozen=True)
class ParamHolding:
    """How this rank holds one parameter. `in_shard`: between steps its values live in its
    bucket's persistent shard (ZeRO-3), not in the parameter. `value_replicas`: the ranks that
    hold its values alike (None: no other rank does). `state_group`: the ranks its optimizer
    state is split over, each holding disjoint flat ranges (None: whole on this rank).
    `state_replicas`: the ranks that hold this rank's optimizer segments of it alike."""

    in_shard: bool
    value_replicas: dist.ProcessGroup | None
    state_group: dist.ProcessGroup | None
    state_replicas: dist.ProcessGroup | None


@dataclass(frozen=True)
class ShardHolding:
    """A bucket's persistent parameter shard (ZeRO-3), read and loaded in place, and the HSDP
    replicas that hold the same shard (None: this rank's alone)."""

    tensor: torch.Tensor
    replicas: dist.ProcessGroup | None


@dataclass(frozen=True)
class CheckpointView:
    """See the module docstring. `params_sharded`: parameters are kept as shards between steps
    (a save gathers them whole first, and holds copies: their storage is freed again). The three
    callables are the assembly steps, no-ops where the level has nothing to do."""

    params_sharded: bool
    shards: tuple[ShardHolding, ...]
    # ZeRO-3: the parameters kept as shards, and per flat range this rank owns of one of them
    # (param, lo, hi, the view of its bucket's persistent shard holding it): what a checkpoint
    # saves and loads in place, with no gather.
    sharded_params: tuple[torch.Tensor, ...]
    shard_segments: tuple[tuple[torch.Tensor, int, int, torch.Tensor], ...]
    _holdings: Mapping[int, ParamHolding]
    gather_whole: Callable[[], None]  # every parameter whole now (collective under ZeRO-3)
    scatter_loaded: Callable[[], None]  # whole values written into the parameters -> the shards
    refresh: Callable[[], None]  # persistent values replaced: bring the parameters up to date

    def holding(self, param: torch.Tensor) -> ParamHolding | None:
        """None for a parameter data parallelism does not hold (frozen, or another chunk's)."""
        return self._holdings.get(id(param))

    @classmethod
    def of(cls, dp: ViewedChunk) -> CheckpointView:
        holdings = {}
        for bucket in dp.buckets:
            shared = bucket.world > 1 and bucket.group is not None
            split = dp.shard and bucket.world > 1
            holding = ParamHolding(
                in_shard=dp.shard_params,
                value_replicas=bucket.group if shared else None,
                state_group=bucket.group if split else None,
                state_replicas=bucket.replica_group if dp.shard else (bucket.group if bucket.world > 1 else None),
            )
            for p in bucket.params:
                holdings[id(p)] = holding
        shards = tuple(ShardHolding(b.param_shard, b.replica_group) for b in dp.buckets) if dp.shard_params else ()
        segments = ()
        if dp.shard_params:
            owned = zip(dp.param_shard_ranges(), dp.param_views(), strict=True)
            segments = tuple((p, lo, hi, view) for (p, lo, hi), view in owned)
        return cls(
            params_sharded=dp.shard_params,
            shards=shards,
            sharded_params=tuple(p for b in dp.buckets for p in b.params) if dp.shard_params else (),
            shard_segments=segments,
            _holdings=holdings,
            gather_whole=dp.gather_all_params,
            scatter_loaded=dp.params_loaded,
            refresh=dp.gather_params,
        )
