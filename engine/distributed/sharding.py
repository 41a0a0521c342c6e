"""The data-parallel sharding levels (`parallel.data_parallel_sharding`) as a table of strategies.

A level is two choices, each a small object DataParallel delegates to:
- how gradients are kept and reduced (`WholeGrads`: every gradient whole in a flat buffer,
  all-reduced or reduce-scattered per bucket at the end of backward; `StagedGrads`: only this
  rank's shard kept, each microbatch's gradients staged per bucket and reduce-scattered into it);
- where parameters live and how they are brought up to date after the step (`InPlace`: the
  module's own tensors, whole on every rank; `FlatBuffer`: views of a flat buffer, each rank's
  updated shard all-gathered per bucket; `UnitShards`: a persistent shard per bucket, gathered
  per layer around each use by param_gather.py).

| level | optimizer state | gradients | parameters |
|---|---|---|---|
| none | whole | WholeGrads, all-reduce | InPlace |
| optim (ZeRO-1) | 1/d | WholeGrads, reduce-scatter | FlatBuffer |
| optim_grads (ZeRO-2) | 1/d | StagedGrads | FlatBuffer |
| optim_grads_params (ZeRO-3/FSDP) | 1/d | StagedGrads | UnitShards |

A bucket's d is its group's size: the DP group, an HSDP shard group, or for MoE experts the
expert data-parallel group. The objects hold the per-step state of their bucket tensors, so the
buckets themselves (data_parallel.py) keep only what the plan gave them and their tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from engine.distributed.bucket import Bucket
from engine.distributed.bucket_plan import Segment
from engine.distributed.collectives import all_gather_into, reduce_scatter_into
from engine.distributed.deferred_init import DeferredInit, materialize
from engine.distributed.param_gather import ParamGatherer, Unit


class BucketOwner(Protocol):
    """The data-parallel chunk the strategies serve (DataParallel, data_parallel.py), as they see
    it: its buckets and flat gradient buffer, its groups' sizes, the step's backward count, and
    where each parameter sits. `units` (layers, under sharded parameters only): the per-layer
    units, the root unit and the layers, for param_gather.py."""

    module: nn.Module
    trainable_params: list[nn.Parameter]
    buckets: list[Bucket]
    group: dist.ProcessGroup | None
    dp: int
    overlap: bool
    grad_dtype: torch.dtype
    grad_buffer: torch.Tensor
    expected_backwards: int
    deferred: DeferredInit | None
    units: tuple[list[Unit], Unit, list[nn.Module]]

    @property
    def gatherer(self) -> ParamGatherer | None: ...

    def bucket_for(self, param: nn.Parameter) -> Bucket: ...

    def segment_for(self, param: nn.Parameter) -> Segment: ...

    def needs_sync(self, bucket: Bucket) -> bool: ...


class WholeGrads:
    """Every parameter's gradient whole in one flat buffer (`param.main_grad` is its view), in the
    buffer's dtype (fp32 with `grad_reduce_in_fp32`) so microbatches accumulate without rounding.
    When the param has the buffer's dtype, `param.grad` is that same view and autograd
    accumulates into the buffer in place (torch DDP's gradient_as_bucket_view); otherwise the
    hook adds each microbatch's grad into `main_grad` and frees it. A bucket is reduced the moment
    every parameter in it has seen its last backward of the step (counted, not signalled, see
    DataParallel.start_step): all-reduced, or with `scatter` reduce-scattered so that each rank
    holds the sum of its shard (copied back into its slice of the bucket)."""

    sharded = False

    def __init__(self, scatter: bool) -> None:
        self.scatter = scatter
        self._seen: dict[int, int] = {}

    def buffer_numel(self, buckets: list[Bucket]) -> int:
        return sum(b.numel for b in buckets)

    def attach(self, dp: BucketOwner, buffer: torch.Tensor) -> None:
        for bucket in dp.buckets:
            bucket.grad = buffer[bucket.offset : bucket.offset + bucket.numel]
            bucket.flight = _WholeFlight(pending=set())
            for p, seg in zip(bucket.params, bucket.plan.segments, strict=True):
                p.main_grad = buffer[seg.offset : seg.offset + seg.numel].view_as(p)
                if p.dtype == buffer.dtype:
                    p.grad = p.main_grad  # autograd accumulates straight into the buffer

    def start_step(self, dp: BucketOwner) -> None:
        self._seen.clear()
        for bucket in dp.buckets:
            bucket.flight = _WholeFlight(pending={id(p) for p in bucket.params})

    def on_ready(self, dp: BucketOwner, param: nn.Parameter) -> None:
        if param.grad is not None and param.grad.data_ptr() != param.main_grad.data_ptr():
            param.main_grad.add_(param.grad)  # other dtype, or someone reset .grad
            param.grad = param.main_grad if param.dtype == param.main_grad.dtype else None
        key = id(param)
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] == dp.expected_backwards:
            bucket = dp.bucket_for(param)
            bucket.flight.pending.discard(key)
            if dp.overlap and not bucket.flight.pending:
                self._launch(dp, bucket)

    def _launch(self, dp: BucketOwner, bucket: Bucket) -> None:
        flight = bucket.flight
        flight.launched = True
        if not dp.needs_sync(bucket):
            return
        # The loss is a mean over this DP rank's samples, so grads average over DP. An expert saw
        # tokens from every rank of its EP group, each scaled by its own rank's 1/samples: the
        # same 1/dp, then a sum over the expert-DP replicas.
        bucket.grad.mul_(1.0 / dp.dp)
        if bucket.world == 1 and bucket.replica_group is None:
            return  # an expert on one expert-DP rank: nothing to sum with
        if self.scatter:
            flight.shard_out = torch.empty(bucket.shard_numel, dtype=bucket.grad.dtype, device=bucket.grad.device)
            flight.work = reduce_scatter_into(flight.shard_out, bucket.grad, group=bucket.group, async_op=True)
        else:
            group = bucket.group if bucket.expert else dp.group
            flight.work = dist.all_reduce(bucket.grad, group=group, async_op=True)

    def finish(self, dp: BucketOwner) -> None:
        for bucket in dp.buckets:
            if not bucket.flight.launched and dp.needs_sync(bucket):
                self._launch(dp, bucket)
        for bucket in dp.buckets:
            flight = bucket.flight
            if flight.work is not None:
                flight.work.wait()
                flight.work = None
            if flight.shard_out is not None:
                if bucket.replica_group is not None:
                    dist.all_reduce(flight.shard_out, group=bucket.replica_group)
                lo, hi = bucket.shard_range()
                bucket.grad[lo:hi].copy_(flight.shard_out)
                flight.shard_out = None

    def view(self, bucket: Bucket, param: nn.Parameter, lo: int, hi: int, shard_offset: int) -> torch.Tensor:
        return param.main_grad.view(-1)[lo:hi]

    def unsharded(self, dp: BucketOwner) -> dict[int, torch.Tensor]:
        return {id(p): p.main_grad.detach().clone() for b in dp.buckets for p in b.params}


@dataclass
class _WholeFlight:
    """One bucket's reduction in this step (WholeGrads)."""

    pending: set[int]  # params yet to see their last backward
    launched: bool = False
    work: object | None = None
    shard_out: torch.Tensor | None = None


@dataclass
class _StagedFlight:
    """One bucket's rounds in this step (StagedGrads): the params whose grad of this microbatch
    is staged in `bucket.grad`, and the reductions in flight (work, reduced shard, staging kept
    alive until the work is done)."""

    round: set[int] = field(default_factory=set)
    inflight: list = field(default_factory=list)


class StagedGrads:
    """No full gradient is kept: each bucket's gradients of one microbatch are staged in a
    transient bucket-sized buffer (`bucket.grad`), reduce-scattered as soon as the last of them
    arrives (while backward goes on) and added into a persistent shard-sized buffer
    (`bucket.grad_shard`), so the optimizer reads this rank's 1/d straight from there. Always
    during backward: `overlap` does not apply, as holding a full gradient until the end is what
    this strategy avoids; the 1/dp of each microbatch's reduction adds up to the step's average.
    Under ZeRO-3 a unit's gathered parameters are freed once all its buckets' rounds are out.
    At most `ROUNDS_IN_FLIGHT` rounds (over all buckets) are in flight: the oldest is waited for
    and added into its shard when another starts, so the staging held at once is the round in
    flight and the bucket being staged, not the whole model's gradient (as when every round was
    kept until the step's end); the round in flight still overlaps the next unit's backward."""

    sharded = True
    ROUNDS_IN_FLIGHT = 1

    def __init__(self) -> None:
        self._rounds_done: dict[int, int] = {}  # per unit: buckets reduced this microbatch
        self._outstanding: deque[Bucket] = deque()  # buckets with a round in flight, oldest first

    def buffer_numel(self, buckets: list[Bucket]) -> int:
        return sum(b.shard_numel for b in buckets)

    def attach(self, dp: BucketOwner, buffer: torch.Tensor) -> None:
        offset = 0
        for bucket in dp.buckets:
            bucket.grad_shard = buffer[offset : offset + bucket.shard_numel]
            offset += bucket.shard_numel
            bucket.grad, bucket.flight = None, _StagedFlight()

    def start_step(self, dp: BucketOwner) -> None:
        for bucket in dp.buckets:
            bucket.grad, bucket.flight = None, _StagedFlight()
        self._rounds_done = {}
        self._outstanding.clear()

    def on_ready(self, dp: BucketOwner, param: nn.Parameter) -> None:
        """Copy this microbatch's grad into the bucket's staging buffer; once every param of the
        bucket has its grad of the microbatch, reduce-scatter it (a round)."""
        bucket = dp.bucket_for(param)
        key, flight = id(param), bucket.flight
        if key in flight.round:  # a second backward before the bucket's other params had theirs
            self._launch_round(dp, bucket)
        if bucket.grad is None:
            bucket.grad = torch.zeros(bucket.numel, dtype=dp.grad_dtype, device=dp.grad_buffer.device)
        seg = dp.segment_for(param)
        start = seg.offset - bucket.offset
        bucket.grad[start : start + seg.numel].view_as(param).copy_(param.grad)
        param.grad = None
        flight.round.add(key)
        if len(flight.round) == len(bucket.params):
            self._launch_round(dp, bucket)

    def _launch_round(self, dp: BucketOwner, bucket: Bucket) -> None:
        staged, bucket.grad, bucket.flight.round = bucket.grad, None, set()
        if bucket.flight.inflight:  # at most one round of a bucket in flight
            self._outstanding.remove(bucket)
            self._drain(bucket)
        if dp.dp > 1:
            staged.mul_(1.0 / dp.dp)  # averaged over DP (see WholeGrads._launch)
        if bucket.world > 1:
            out = torch.empty(bucket.shard_numel, dtype=staged.dtype, device=staged.device)
            work = reduce_scatter_into(out, staged, group=bucket.group, async_op=True)
            bucket.flight.inflight.append((work, out, staged))
        else:
            bucket.flight.inflight.append((None, staged, None))
        self._outstanding.append(bucket)
        while len(self._outstanding) > self.ROUNDS_IN_FLIGHT:
            self._drain(self._outstanding.popleft())
        unit, gatherer = bucket.unit, dp.gatherer
        if unit is not None and gatherer is not None:
            done = self._rounds_done.get(id(unit), 0) + 1
            if done == len(unit.buckets):  # the unit's backward of this microbatch is over
                done = 0
                gatherer.free(unit)
            self._rounds_done[id(unit)] = done

    @staticmethod
    def _drain(bucket: Bucket) -> None:
        for work, out, _ in bucket.flight.inflight:
            if work is not None:
                work.wait()
            if bucket.replica_group is not None:
                dist.all_reduce(out, group=bucket.replica_group)
            bucket.grad_shard.add_(out)
        bucket.flight.inflight = []

    def finish(self, dp: BucketOwner) -> None:
        for bucket in dp.buckets:
            if bucket.grad is not None:
                self._launch_round(dp, bucket)
        while self._outstanding:
            self._drain(self._outstanding.popleft())

    def view(self, bucket: Bucket, param: nn.Parameter, lo: int, hi: int, shard_offset: int) -> torch.Tensor:
        return bucket.grad_shard[shard_offset : shard_offset + hi - lo]

    def unsharded(self, dp: BucketOwner) -> dict[int, torch.Tensor]:
        out = {}
        for bucket in dp.buckets:
            full = torch.empty(bucket.numel, dtype=bucket.grad_shard.dtype, device=bucket.grad_shard.device)
            if bucket.world > 1:
                all_gather_into(full, bucket.grad_shard.clone(), group=bucket.group)
            else:
                full.copy_(bucket.grad_shard)
            for p, seg in zip(bucket.params, bucket.plan.segments, strict=True):
                start = seg.offset - bucket.offset
                out[id(p)] = full[start : start + seg.numel].view(p.shape).clone()
        return out


class InPlace:
    """Parameters stay the module's own tensors, whole on every rank; the optimizer steps them
    whole, so there is nothing to share after the step."""

    gatherer: ParamGatherer | None = None
    by_unit = False

    def attach(self, dp: BucketOwner, dtype: torch.dtype, device: torch.device) -> None:
        for p in dp.trainable_params:  # a model built on the meta device: each parameter gets its own tensor
            if p.is_meta:
                materialize(p, torch.empty(p.shape, dtype=p.dtype, device=device), dp.deferred)

    def view(self, bucket: Bucket, param: nn.Parameter, lo: int, hi: int, shard_offset: int) -> torch.Tensor:
        return param.detach().view(-1)[lo:hi]

    def after_backward(self) -> None:
        pass

    def after_step(self, dp: BucketOwner) -> None:
        pass

    def gather_all(self) -> None:
        pass

    def loaded(self, dp: BucketOwner) -> None:
        pass

    def memory_bytes(self, dp: BucketOwner) -> int:
        return sum(p.numel() * p.element_size() for p in dp.module.parameters())


class FlatBuffer(InPlace):
    """Parameters are views of one flat buffer laid out like the gradients' (`bucket.param`), so
    that after each rank has updated its shard one all-gather per bucket brings every rank's
    parameters up to date (the distributed optimizer)."""

    def attach(self, dp: BucketOwner, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.zeros(sum(b.numel for b in dp.buckets), dtype=dtype, device=device)
        for bucket in dp.buckets:
            bucket.param = self.buffer[bucket.offset : bucket.offset + bucket.numel]
            _move_into(bucket, bucket.param, dp.deferred)

    @torch.no_grad()
    def after_step(self, dp: BucketOwner) -> None:
        works = []
        for bucket in dp.buckets:
            if bucket.world == 1:  # this rank updated all of it
                continue
            lo, hi = bucket.shard_range()
            mine = bucket.param[lo:hi].clone()
            works.append(all_gather_into(bucket.param, mine, group=bucket.group, async_op=True))
        for w in works:
            w.wait()


class UnitShards(InPlace):
    """ZeRO-3 / FSDP: each bucket keeps a persistent shard (`bucket.param_shard`, what the
    optimizer updates) and a full buffer (`bucket.full`) its parameters are views of, freed
    between uses; param_gather.py gathers a layer's buckets around its forward and backward. The
    buckets were planned by unit (bucket_plan.py), so a unit is gathered whole.

    Attaching takes one bucket at a time: its full buffer is allocated, its parameters moved
    (or, built on the meta device, materialised and initialised) into it, this rank's shard
    cut out, and the buffer freed before the next bucket, so the model is never whole here."""

    by_unit = True

    @torch.no_grad()
    def attach(self, dp: BucketOwner, dtype: torch.dtype, device: torch.device) -> None:
        for bucket in dp.buckets:
            bucket.full = torch.zeros(bucket.numel, dtype=dtype, device=device)
            _move_into(bucket, bucket.full, dp.deferred)
            lo, hi = bucket.shard_range()
            bucket.param_shard = bucket.full[lo:hi].clone()
            bucket.full.untyped_storage().resize_(0)  # gathered around each use (param_gather.py)
        units, root, layers = dp.units
        self.gatherer = ParamGatherer(dp.module, units, root, layers)

    def view(self, bucket: Bucket, param: nn.Parameter, lo: int, hi: int, shard_offset: int) -> torch.Tensor:
        return bucket.param_shard[shard_offset : shard_offset + hi - lo]

    def after_backward(self) -> None:
        self.gatherer.free_all()

    def after_step(self, dp: BucketOwner) -> None:
        # Drop any gathered copy, now stale; each use gathers the new shards.
        self.gatherer.free_all()

    def gather_all(self) -> None:
        self.gatherer.gather_all()

    def loaded(self, dp: BucketOwner) -> None:
        for bucket in dp.buckets:
            lo, hi = bucket.shard_range()
            bucket.param_shard.copy_(bucket.full[lo:hi])

    def memory_bytes(self, dp: BucketOwner) -> int:
        return sum(
            b.param_shard.numel() * b.param_shard.element_size() + b.full.untyped_storage().nbytes()
            for b in dp.buckets
        )


def _move_into(bucket: Bucket, home: torch.Tensor, deferred: DeferredInit | None) -> None:
    """Each parameter of `bucket` becomes a view of its segment of `home` (a bucket-sized
    tensor): its values copied in, or drawn there when it was built on the meta device."""
    for p, seg in zip(bucket.params, bucket.plan.segments, strict=True):
        start = seg.offset - bucket.offset
        materialize(p, home[start : start + seg.numel], deferred)


@dataclass(frozen=True)
class ShardingLevel:
    """One row of the table: what the level shards, and the strategies (factories: they hold
    per-step state) for gradients and parameters."""

    name: str
    shards_optimizer: bool  # each rank steps 1/d of every bucket
    grads: Callable[[], WholeGrads | StagedGrads]
    params: type[InPlace]

    @property
    def shards_grads(self) -> bool:
        return getattr(self.grads, "func", self.grads).sharded

    @property
    def shards_params(self) -> bool:
        return self.params.by_unit


LEVELS: dict[str, ShardingLevel] = {
    level.name: level
    for level in (
        ShardingLevel("none", False, partial(WholeGrads, scatter=False), InPlace),
        ShardingLevel("optim", True, partial(WholeGrads, scatter=True), FlatBuffer),
        ShardingLevel("optim_grads", True, StagedGrads, FlatBuffer),
        ShardingLevel("optim_grads_params", True, StagedGrads, UnitShards),
    )
}
SHARDING_LEVELS = tuple(LEVELS)
