"""Which gradients count in the global norm, and clipping.

Each parameter counts exactly once in the norm: a TP-sharded parameter contributes its shard on
every TP rank (the shards are disjoint); a TP-replicated one (norm weights, row-parallel biases)
only on TP rank 0; the last pipeline stage's copy of a tied embedding not at all. The optimizer
then sums the squares over the model-parallel group (TP x PP), or over every rank when the
distributed optimizer splits gradients over data parallel too.
"""

from __future__ import annotations

import torch

from engine import parallel_state as ps
from engine.parallel_placement import placement_of


def counts_in_norm(param: torch.Tensor) -> bool:
    return placement_of(param).tensor_parallel or ps.get_tensor_model_parallel_rank() == 0


@torch.no_grad()
def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    if max_norm <= 0 or not grads:
        return
    coeff = max_norm / (total_norm + 1e-6)
    if coeff < 1.0:
        torch._foreach_mul_(grads, coeff)
