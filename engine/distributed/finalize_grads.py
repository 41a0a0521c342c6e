"""Make every rank's gradients final before the optimizer step.

1. Sequence-parallel params (norm weights, row-parallel biases, position embeddings under SP)
   saw only one sequence chunk per TP rank: sum their grads over TP.
2. Data parallel: average grads over DP replicas.

Each is one coalesced all-reduce over a flat buffer. This is the simple, non-overlapped form:
bucketed reduction launched during backward replaces step 2 for data parallelism at scale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from engine import parallel_state as ps


def _all_reduce_coalesced(grads: list[torch.Tensor], group, scale: float = 1.0) -> None:
    if not grads:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        for g, reduced in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            g.copy_(reduced)


@torch.no_grad()
def finalize_model_grads(model: nn.Module) -> None:
    params = [p for p in model.parameters() if p.grad is not None]
    if ps.get_tensor_model_parallel_world_size() > 1:
        sp = [p.grad for p in params if getattr(p, "sequence_parallel", False)]
        _all_reduce_coalesced(sp, ps.get_tensor_model_parallel_group())
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        _all_reduce_coalesced([p.grad for p in params], ps.get_group("dp"), scale=1.0 / dp)
