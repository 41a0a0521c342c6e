"""Flat-tensor collectives under one name for every torch this project admits.

torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
reduce_scatter_single (the old names warn); older releases only have the old names. Gloo only
accepts the concatenated form ([world * n, ...] output), so callers always gather along dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """output [world * n, ...] <- every rank's input [n, ...], in rank order."""
    return _all_gather(output, input, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """output [n, ...] <- this rank's chunk of the sum of every rank's input [world * n, ...]."""
    return _reduce_scatter(output, input, group=group, async_op=async_op)
