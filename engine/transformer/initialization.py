"""Layout-independent weight initialisation.

Each parameter is drawn whole (its placement's global `shape`) from a generator seeded by (seed, the
parameter's name in the whole model: global layer numbers on every pipeline stage), then this
rank keeps its shard. The same seed therefore gives the same model on one rank
and on any tensor/pipeline-parallel layout, which is what lets every parallel run be checked against the
single-rank run. The cost is one transient full-size tensor per parameter at start-up.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

from engine import parallel_state as ps
from engine.parallel_placement import placement_of
from engine.tensor_parallel import shard_of


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


@torch.no_grad()
def initialize_weights(model: nn.Module, seed: int, only: Callable[[str], bool] | None = None) -> None:
    """Weights: normal(0, the placement's init_std); norm weights: 1; biases and std-0 params: 0.
    `only`: initialise just the parameters whose global name it accepts (the rest are imported)."""
    global_name = getattr(model, "global_param_name", lambda n: n)
    for name, param in model.named_parameters():
        name = global_name(name)
        if only is not None and not only(name):
            continue
        initialize_param(param, name, seed)


def global_names(model: nn.Module) -> dict[int, str]:
    """id(param) -> its name in the whole model (what `initialize_param` seeds by)."""
    global_name = getattr(model, "global_param_name", lambda n: n)
    return {id(p): global_name(name) for name, p in model.named_parameters()}


@torch.no_grad()
def initialize_param(param: nn.Parameter, name: str, seed: int) -> None:
    """One parameter, `name` being its global name: what `initialize_weights` does to each. Also
    the fill of a model built on the meta device (engine/distributed/deferred_init.py), called
    on each parameter once it has its storage."""
    world, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    placement = placement_of(param)
    shape, std = placement.shape, placement.init_std
    if std is None:  # norms: scale 1, shift 0
        full = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    elif std == 0.0:
        full = torch.zeros(shape)
    else:
        full = torch.empty(shape).normal_(0.0, std, generator=_generator(seed, name))
    local = shard_of(full, placement.tp_dim, placement.tp_stride, rank, world)
    param.copy_(local.to(param.dtype))
