"""Parameters kept as shards between uses (ZeRO-3 / FSDP, `data_parallel_sharding:
optim_grads_params`): each layer's parameters are all-gathered just before its forward and its
backward and freed right after.

A *unit* is what is gathered at once: one transformer layer each (`model.fsdp_units()`), and
the model's own parameters outside them (embeddings, final norm, output layer), the root. A
unit's buckets each have a persistent shard (1/d of the bucket over the bucket's own group: the
data-parallel shard group, or for MoE experts the expert data-parallel group; what the optimizer
updates) and a full buffer the unit's parameters are views of. Freeing a unit resizes the full buffer's
storage to zero and gathering resizes it back and all-gathers into it, so the parameters stay
the same objects, with the same shapes and autograd identity: tensors saved for backward refer
to the same storage and see the gathered values again when backward runs (torch FSDP1's
technique, which needs no DTensor).

When: a forward pre-hook gathers the unit (waiting if a prefetch is in flight) and starts the
next unit's gather, so that communication overlaps the unit's compute; the forward post-hook
frees it and puts a hook on its output whose gradient arrives just before the unit's backward:
the hook gathers the unit again and starts the previous unit's gather (backward prefetch). The data-parallel reduction frees a
unit once every gradient of its parameters for the microbatch has been reduce-scattered. The
root is freed only after its backward (its embedding is used first in forward and last in
backward; a tied output layer shares it). Hooks that run during backward (activation recompute
re-running a layer's forward) neither prefetch nor free.

Written by hand rather than with torch's FSDP2 (`fully_shard`), after a spike on gloo: FSDP2
replaces every parameter with a new DTensor parameter, which drops the placement our tensor
parallelism, gradient finalisation and checkpoints read (engine/parallel_placement.py: it
travels with the parameter object), and puts per-parameter DTensor gradients in `.grad`, outside the flat
buffers the optimizer's fp32 masters, the grad-norm/clipping and the counted-backward bucket
reduction (needed by pipeline schedules that call backward themselves) are built on. Using it
would mean rewriting those, and the checkpoint's global-coordinate state, around DTensors.
Here the same buckets serve every sharding level, on CPU (gloo) and CUDA alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.distributed.collectives import all_gather_into


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. a recompute's forward)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class Unit:
    """Buckets gathered and freed together; `index` is its place in forward order (root: -1)."""

    index: int
    buckets: list = field(default_factory=list)
    works: list = field(default_factory=list)
    gathered: bool = False


class ParamGatherer:
    """Owns the units of one model chunk: their hooks, gathers, prefetches and frees."""

    def __init__(self, module: nn.Module, units: list[Unit], root: Unit, layers: list[nn.Module]) -> None:
        self.units, self.root = units, root
        self._hooks = []
        for unit, layer in zip(units, layers, strict=True):
            self._hooks.append(layer.register_forward_pre_hook(self._pre_hook(unit)))
            self._hooks.append(layer.register_forward_hook(self._post_hook(unit, free=True)))
        self._hooks.append(module.register_forward_pre_hook(self._pre_hook(root)))
        self._hooks.append(module.register_forward_hook(self._post_hook(root, free=False)))

    def next(self, unit: Unit) -> Unit | None:
        i = unit.index + 1
        return self.units[i] if i < len(self.units) else None

    def previous(self, unit: Unit) -> Unit | None:
        if unit is self.root:
            return self.units[-1] if self.units else None
        return self.units[unit.index - 1] if unit.index > 0 else None

    @torch.no_grad()
    def prefetch(self, unit: Unit | None) -> None:
        """Start gathering `unit` (no wait); nothing if it is gathered or on its way."""
        if unit is None or unit.gathered or unit.works:
            return
        for b in unit.buckets:
            b.full.untyped_storage().resize_(b.full.numel() * b.full.element_size())
            if b.world == 1:  # this rank's shard is the whole bucket
                b.full.copy_(b.param_shard)
                continue
            unit.works.append(all_gather_into(b.full, b.param_shard, group=b.group, async_op=True))

    def ensure(self, unit: Unit) -> None:
        """`unit`'s parameters hold the full, current values when this returns."""
        if unit.gathered:
            return
        self.prefetch(unit)
        for w in unit.works:
            w.wait()
        unit.works, unit.gathered = [], True

    def free(self, unit: Unit) -> None:
        if unit.works:  # a prefetch nobody used: let it land before dropping the memory
            self.ensure(unit)
        if not unit.gathered:
            return
        for b in unit.buckets:
            b.full.untyped_storage().resize_(0)
        unit.gathered = False

    def free_all(self) -> None:
        for unit in [*self.units, self.root]:
            self.free(unit)

    def gather_all(self) -> None:
        """Every parameter whole (checkpoint save and load); freed again by the next step."""
        for unit in [self.root, *self.units]:
            self.prefetch(unit)
        for unit in [self.root, *self.units]:
            self.ensure(unit)

    def _pre_hook(self, unit: Unit):
        def hook(module, args):
            self.ensure(unit)
            if not in_backward():
                self.prefetch(self.units[0] if unit is self.root and self.units else self.next(unit))

        return hook

    def _backward_hook(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            self.ensure(unit)
            self.prefetch(self.previous(unit))

        return hook

    def _post_hook(self, unit: Unit, free: bool):
        def hook(module, args, output):
            if in_backward():  # a recompute: backward needs the unit now
                return output
            if not torch.is_grad_enabled():
                self.free(unit)
                return output
            if free:
                self.free(unit)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._backward_hook(unit))
            return output

        return hook
