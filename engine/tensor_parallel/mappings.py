"""Autograd communication regions for tensor and sequence parallelism.

Each region is a pair (forward collective, backward collective) over the tensor-parallel group,
written as an autograd.Function so the model code only says where a region starts or ends and
the backward pass follows by itself. Activations are [sequence, batch, hidden]; sequence
parallel regions split dim 0 (contiguous chunks, so gather/scatter need no copies), tensor
parallel regions split the last dim. With one TP rank every region is the identity and costs
nothing.

Written by hand rather than with DTensor: the layers, the distributed optimizer and the
Transformer Engine spec all work on plain tensors and a raw process group, and the regions make
every collective of a step explicit (so it can be timed, overlapped and reasoned about).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.distributed.collectives import all_gather_into, reduce_scatter_into


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else ps.get_tensor_model_parallel_group()


def _world(group: dist.ProcessGroup | None) -> int:
    if group is None and not ps.model_parallel_is_initialized():
        return 1
    return dist.get_world_size(_group(group))


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=_group(group))
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x, group=_group(group))
    if dim % x.dim() == 0:
        return out
    return torch.cat(out.chunk(world, dim=0), dim=dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {world} tensor-parallel ranks")
    rank = dist.get_rank(_group(group))
    return x.chunk(world, dim=dim)[rank].contiguous()


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group and keep this rank's chunk of dim 0."""
    world = _world(group)
    if world == 1:
        return x
    if x.shape[0] % world:
        raise ValueError(f"cannot reduce-scatter dim 0 of size {x.shape[0]} over {world} ranks")
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    reduce_scatter_into(out, x.contiguous(), group=_group(group))
    return out


class _CopyToRegion(torch.autograd.Function):
    """Enter a TP region with a replicated input: identity forward, all-reduce of the grad."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Leave a TP region with partial sums: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim; the backward gathers it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """Gather the last dim from all TP ranks; the backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Replicated [s, b, h] -> this rank's sequence chunk; backward all-gathers the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 0, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Sequence chunks -> full sequence. Backward reduce-scatters when the consumer is a TP
    region (each rank's grad is a partial sum), otherwise just keeps this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.reduce = group, tensor_parallel_output_grad
        return _all_gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            return _reduce_scatter(grad, ctx.group), None, None
        return _split(grad, 0, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Partial sums [s, b, h] -> summed sequence chunk; backward all-gathers the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 0, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _world(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _world(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _world(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _world(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _world(group) == 1 else _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, tensor_parallel_output_grad: bool = True, group=None
) -> torch.Tensor:
    return x if _world(group) == 1 else _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _world(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)


def all_gather_along(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Plain (non-autograd) gather, for tests and state assembly."""
    return _all_gather(x, dim, group)
