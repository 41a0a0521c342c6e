"""Models built without their weights: parameters on the meta device, filled in place later.

A model is never whole on a rank when data parallelism shards its parameters: the model is
built with every parameter on the meta device (shape, dtype and placement, no storage), and
DataParallel materialises each parameter straight into the memory that will hold it (its
bucket's gathered buffer under optim_grads_params, freed again once this rank's shard is cut
out of it; the flat parameter buffer under optim and optim_grads; a tensor of its own under
none), where `DeferredInit.fill` draws its values. The fill is the layout-independent
initialisation (engine/transformer/initialization.py: each parameter drawn whole from a
generator seeded by its global name), so a deferred model equals an eagerly built one bit for
bit, on any layout.

Parameters keep their identity throughout (torch.utils.swap_tensors swaps the storage under
the same Python object): placements, tied parameters shared by two modules and anything that
kept a reference stay valid. Buffers (rotary frequencies, MoE expert bias) are built for real:
they are small and some are computed at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class DeferredInit:
    """Where meta parameters are materialised, and how one is filled (in place, no grad)."""

    device: torch.device
    fill: Callable[[nn.Parameter], None]


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to the meta device as it is registered, so
    constructors that draw or fill their weights (nn.Linear's reset_parameters) do so on meta:
    no storage, and no draw from the global random stream either."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            _swap(param, torch.empty_like(param, device="meta"))

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _swap(param: nn.Parameter, data: torch.Tensor) -> None:
    """`param` (the same object) now holds `data`, keeping its attributes (the placement)."""
    attrs = dict(param.__dict__)
    torch.utils.swap_tensors(param, nn.Parameter(data, requires_grad=param.requires_grad))
    param.__dict__.update(attrs)


@torch.no_grad()
def materialize(param: nn.Parameter, home: torch.Tensor, deferred: DeferredInit | None) -> None:
    """Make `param` a view of `home` (its shape, already allocated where it will live): a meta
    parameter is filled by `deferred`, a real one copied in."""
    view = home.view(param.shape)
    if param.is_meta:
        if deferred is None:
            raise ValueError("a parameter on the meta device needs a DeferredInit to be materialised")
        # Swapped to an empty tensor of the right kind first, then pointed at the view: `.data =`
        # keeps the parameter's own version counter (a Parameter made from the view would share
        # the buffer's, and the gathers that write into it would look like in-place changes to
        # tensors autograd saved).
        _swap(param, torch.empty(0, dtype=param.dtype, device=home.device))
        param.data = view
        deferred.fill(param)
    else:
        view.copy_(param.data)
        param.data = view


def materialize_rest(module: nn.Module, deferred: DeferredInit) -> None:
    """Materialise the meta parameters nobody placed (frozen ones, which data parallelism does
    not hold) in tensors of their own."""
    for param in module.parameters():
        if param.is_meta:
            materialize(param, torch.empty(param.shape, dtype=param.dtype, device=deferred.device), deferred)


def buffers_to(module: nn.Module, device: torch.device) -> None:
    """`module.to(device)` for its buffers only (its parameters are on the meta device)."""
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[name] = buf.to(device)
