"""Global gradient norm and clipping across every parallel group.

Each parameter counts exactly once in the norm: a TP-sharded parameter contributes its shard
on every TP rank (the shards are disjoint); a TP-replicated one (norm weights, row-parallel
biases) only on TP rank 0. The squared sums are then added over the model-parallel group (TP x
PP). Data-parallel replicas already hold the same averaged gradients, so DP is not summed.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine import parallel_state as ps


def counts_in_norm(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) or ps.get_tensor_model_parallel_rank() == 0


@torch.no_grad()
def global_grad_norm(grads: list[torch.Tensor]) -> float:
    """L2 norm over all ranks' `grads` (the caller passes only the grads that count here)."""
    if grads:
        local = torch.stack(torch._foreach_norm([g.float() for g in grads])).square().sum()
    else:
        local = torch.zeros((), dtype=torch.float32)
    if ps.model_parallel_is_initialized() and ps.get_size_of("mp") > 1:
        local = local.reshape(1)
        dist.all_reduce(local, group=ps.get_group("mp"))
    return math.sqrt(float(local.sum()))


@torch.no_grad()
def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    if max_norm <= 0 or not grads:
        return
    coeff = max_norm / (total_norm + 1e-6)
    if coeff < 1.0:
        torch._foreach_mul_(grads, coeff)
