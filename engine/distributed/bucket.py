"""One bucket of DataParallel's flat gradient buffer, as the data-parallel wrapper
(data_parallel.py) builds it and the sharding levels' strategies (sharding.py) fill and reduce it.

Its own module so that both can name it: the strategies sit below the wrapper that delegates to
them, and see the wrapper itself only as the `BucketOwner` protocol they declare.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed.bucket_plan import BucketPlan
from engine.distributed.param_gather import Unit


@dataclass(eq=False)
class Bucket:
    """A planned bucket with its parameters, the group it is reduced and sharded over (dense:
    the DP or HSDP shard group; experts: the expert data-parallel group), this rank's place in
    it, the HSDP replica group its reduced shards are then summed over (dense only), and the
    tensors the level's strategies keep for it; `flight` is the gradient strategy's state for
    the current step."""

    plan: BucketPlan
    params: list[nn.Parameter]
    group: object | None = None
    rank: int = 0
    replica_group: object | None = None
    grad: torch.Tensor | None = None  # the whole gradient's view, or a staging buffer (sharded grads)
    grad_shard: torch.Tensor | None = None  # this rank's persistent reduced gradient (sharded grads)
    param: torch.Tensor | None = None  # view of the flat parameter buffer (FlatBuffer)
    param_shard: torch.Tensor | None = None  # persistent parameter shard (UnitShards)
    full: torch.Tensor | None = None  # gathered parameters, freed between uses (UnitShards)
    unit: Unit | None = None
    flight: object | None = None

    @property
    def offset(self) -> int:
        return self.plan.offset

    @property
    def numel(self) -> int:
        return self.plan.numel

    @property
    def world(self) -> int:
        return self.plan.world

    @property
    def expert(self) -> bool:
        return self.plan.expert

    @property
    def shard_numel(self) -> int:
        return self.plan.shard_numel

    def shard_range(self) -> tuple[int, int]:
        """This rank's slice of the bucket, as offsets into the bucket."""
        return self.plan.shard_range(self.rank)
