"""Where a parameter lives in the whole model: one typed record per parameter.

The model's layers say where each parameter sits (its global shape, the dimension tensor
parallelism splits and into how many independently split chunks, whether its gradient is a
partial sum over TP, whether it is an MoE expert or a tied embedding and its copy, how to draw
it), and everything downstream reads that one description: layout-independent initialisation,
data parallelism's buckets, gradient finalisation, the optimizer's norm, the checkpoint's global
offsets, the Hugging Face importer. It used to be ten untyped attributes set on the parameter
here and there; now `set_placement` and `placement_of` are the only way in and out, and a test
(tests/engine/test_parallel_placement.py) fails if code outside this module touches the old
attribute names.

What is not here, on purpose:
- which data-parallel bucket holds the parameter and which shard of it this rank owns: that
  depends on the DP size, the sharding level and the bucket size, not on the model, differs
  between DP ranks of the same parameter, and changes when the job is resized; DataParallel
  records it in its own plan and view (engine/distributed/bucket_plan.py, data_parallel.py);
- `param.main_grad`, the gradient's view into DataParallel's flat buffer: runtime state with
  the buffer's lifetime, owned and read by engine/distributed only (torch's and Megatron's
  convention for "the reduced gradient lives here").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

_ATTR = "_parallel_placement"


@dataclass(frozen=True)
class ParamPlacement:
    """`shape`: the global (unsharded) shape. `tp_dim`: the dimension split over tensor-parallel
    ranks (None: replicated over TP). `tp_stride`: how many independently split chunks the global
    tensor is made of along `tp_dim` (2 for SwiGLU's fused gate|up weight). `tp_partial_grad`: a
    replicated parameter whose gradient is a partial sum over TP ranks (under sequence
    parallelism: norms, row-parallel biases, position embeddings, the router; always: per-head
    q/k norms), summed over TP before the step. `expert`: an MoE expert's parameter, reduced and
    sharded over the expert data-parallel group. `tied_embedding`: one of the copies of an
    embedding kept equal across pipeline stages (its gradient is summed over the embedding group;
    data parallelism gives it a bucket of its own so both stages' shards line up). `tied_copy`:
    the copy that is not the embedding itself (the last stage's output weight or MTP embedding):
    it does not count in the gradient norm. `init_std`: normal(0, std) at initialisation; 0:
    zeros; None: a norm (weight 1, bias 0)."""

    shape: tuple[int, ...]
    tp_dim: int | None = None
    tp_stride: int = 1
    tp_partial_grad: bool = False
    expert: bool = False
    tied_embedding: bool = False
    tied_copy: bool = False
    init_std: float | None = None

    def __post_init__(self) -> None:
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(self.shape):
            raise ValueError(f"tp_dim {self.tp_dim} is not a dimension of shape {self.shape}")
        if self.tp_stride < 1:
            raise ValueError(f"tp_stride must be >= 1, not {self.tp_stride}")
        if self.tied_copy and not self.tied_embedding:
            raise ValueError("a tied copy is a tied embedding")

    @property
    def tensor_parallel(self) -> bool:
        """Split over TP ranks: each rank's piece is disjoint, so it counts in the norm on every rank."""
        return self.tp_dim is not None


def placement_of(param: torch.Tensor) -> ParamPlacement:
    """The parameter's placement; one that nobody set is whole, replicated, a norm-like default."""
    placement = getattr(param, _ATTR, None)
    return placement if placement is not None else ParamPlacement(shape=tuple(param.shape))


def set_placement(param: torch.Tensor, placement: ParamPlacement | None = None, /, **changes) -> ParamPlacement:
    """Attach `placement` (default: the parameter's current one) with `changes` applied, e.g.
    `set_placement(w, init_std=0.02)`; returns what is attached now."""
    new = replace(placement if placement is not None else placement_of(param), **changes)
    setattr(param, _ATTR, new)
    return new
