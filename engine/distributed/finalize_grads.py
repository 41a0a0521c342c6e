"""Make every rank's gradients final before the optimizer step.

1. Data parallel: wait for every bucket's reduction (most were launched during backward).
2. Params placed with `tp_partial_grad` have a partial grad on each TP rank: sum it over TP. Under
   SP those are norm weights, row-parallel biases, position embeddings and the router (each TP
   rank saw one sequence chunk); with or without SP the per-head q/k norms (each rank's heads).
3. A tied embedding split across pipeline stages: sum the first stage's embedding grad and the
   last stage's output-weight grad over the embedding group, so both copies take the same step.

All sums are linear, so their order does not matter. With the distributed optimizer only this
rank's shard of `main_grad` is meaningful after step 1; steps 2 and 3 still reduce the whole
tensor, which is right because the ranks they reduce with hold the same bucket layout (TP peers
build the same model; a tied embedding has a bucket of its own on both stages). With sharded
gradients (optim_grads and up) only the shard exists, and steps 2 and 3 reduce this rank's
segments of it, which the same argument lines up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from engine import parallel_state as ps
from engine.distributed.data_parallel import DataParallel
from engine.parallel_placement import ParamPlacement, placement_of


def all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    """Sum each tensor over `group` in place, one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        for t, reduced in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            t.copy_(reduced)


@torch.no_grad()
def finalize_model_grads(chunks: list[DataParallel]) -> None:
    for chunk in chunks:
        chunk.finish_grad_sync()
    if ps.get_tensor_model_parallel_world_size() > 1:
        sp = _grads_marked(chunks, lambda pl: pl.tp_partial_grad)
        if sp:
            all_reduce_coalesced(sp, ps.get_tensor_model_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        tied = _grads_marked(chunks, lambda pl: pl.tied_embedding)
        if tied:
            all_reduce_coalesced(tied, ps.get_group("embd"))


def _grads_marked(chunks: list[DataParallel], mark: Callable[[ParamPlacement], bool]) -> list[torch.Tensor]:
    """The reduced gradients of the params whose placement `mark` accepts: whole main_grads, or this rank's
    shard segments when gradients are sharded (no full gradient exists then)."""
    out = []
    for chunk in chunks:
        if chunk.shard_grads:
            segments = zip(chunk.param_shard_ranges(), chunk.grad_views(), strict=True)
            out.extend(g for (p, _, _), g in segments if mark(placement_of(p)))
        else:
            params = [p for p in chunk.module.parameters() if p.requires_grad]
            out.extend(p.main_grad for p in params if mark(placement_of(p)))
    return out
