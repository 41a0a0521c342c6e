"""The training optimizer: AdamW over fp32 master weights, with loss scaling and global clipping.

It steps whatever slice of the model this rank owns, as (param, lo, hi) segments handed out by
the data-parallel buffers: whole parameters normally, this rank's 1/dp of every bucket with the
distributed optimizer (ZeRO-1) and the higher sharding levels (whose gradients and parameters
live in shard buffers, handed out as views). Each segment has an fp32 master: a view of the parameter itself
when the model is fp32 (nothing copied), an fp32 clone for bf16/fp16 models (small updates are
not rounded away; the result is copied back). Gradients come from `param.main_grad`, already
reduced over data parallel. Weight decay applies to matrices only, as in Megatron-Core; the
scheduler sets it per group through `wd_mult`.

The step, in order: fp16 unscale + overflow check (skip the step and lower the scale on inf/nan,
agreed by every rank), global grad norm, clip, AdamW, copy back, all-gather of the updated
shards (distributed optimizer).

Checkpoints read and restore its state only through the accessors at the end of the class (each
segment's master and Adam's moments by name, Adam's step); torch's AdamW state layout stays in
adam_state.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import device
from engine.distributed.data_parallel import DataParallel
from engine.jobspec import OptimizerSpec
from engine.optimizer import adam_state
from engine.optimizer.clip_grads import clip_grads_, counts_in_norm
from engine.optimizer.grad_scaler import DynamicGradScaler
from engine.parallel_placement import placement_of


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros(1, device=device.current_device())
    return torch.stack(torch._foreach_norm(grads)).square().sum().reshape(1)


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool = False
    loss_scale: float = 1.0


class TrainingOptimizer:
    def __init__(
        self,
        chunks: list[DataParallel],
        spec: OptimizerSpec,
        *,
        norm_group: dist.ProcessGroup | None,
        grad_scaler: DynamicGradScaler | None = None,
        expert_norm_group: dist.ProcessGroup | None = None,
    ):
        self.spec, self.chunks, self.norm_group, self.grad_scaler = spec, chunks, norm_group, grad_scaler
        # MoE: each expert lives on one rank of this group (expert TP x EP x PP), so its squares
        # are summed there instead of over norm_group. Set on every rank of an MoE model.
        self.expert_norm_group = expert_norm_group
        self.segments = [seg for c in chunks for seg in c.param_shard_ranges()]
        # Where each segment's values and reduced gradient live: slices of the parameter and its
        # main_grad, or of the buckets' persistent shards when those are sharded (data_parallel.py).
        self.param_views = [v for c in chunks for v in c.param_views()]
        self.grad_views = [g for c in chunks for g in c.grad_views()]
        self.main_params: list[torch.Tensor] = []
        self.needs_copy_back: list[bool] = []
        for (p, _, _), view in zip(self.segments, self.param_views, strict=True):
            fp32 = p.dtype == torch.float32
            self.main_params.append(view if fp32 else view.float().clone())
            self.needs_copy_back.append(not fp32)
        self.is_expert = [placement_of(p).expert for p, _, _ in self.segments]
        self.counts = [
            not e and counts_in_norm(p) and not placement_of(p).tied_copy
            for (p, _, _), e in zip(self.segments, self.is_expert, strict=True)
        ]
        decay = [m for m, (p, _, _) in zip(self.main_params, self.segments, strict=True) if p.dim() > 1]
        no_decay = [m for m, (p, _, _) in zip(self.main_params, self.segments, strict=True) if p.dim() <= 1]
        groups = [
            {"params": decay, "wd_mult": 1.0},
            {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0},
        ]
        self.inner = torch.optim.AdamW(
            [g for g in groups if g["params"]] or [{"params": [torch.zeros(0)]}],
            lr=spec.lr,
            betas=(spec.adam_beta1, spec.adam_beta2),
            eps=spec.adam_eps,
            weight_decay=spec.weight_decay,
            # One kernel for the whole update on GPU (the foreach path launches several per
            # tensor list); CPU keeps foreach, whose results the CPU tests pin bitwise.
            **({"fused": True} if self.main_params and self.main_params[0].is_cuda else {"foreach": True}),
        )
        self._prepared: tuple[list[torch.Tensor], StepResult] | None = None

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def _grads(self) -> list[torch.Tensor]:
        return [g if g.dtype == torch.float32 else g.float() for g in self.grad_views]

    def _all_reduce(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if dist.is_initialized() and dist.get_world_size(self.norm_group) > 1:
            dist.all_reduce(value, op=op, group=self.norm_group)
        return value

    @torch.no_grad()
    def prepare(self) -> StepResult:
        """Unscale the gradients now in the buffers, check them for overflow and take their global
        norm, without stepping. Separate from `step` so the training loop can validate the norm
        (rerun state machine) before it decides to update the weights; `step` reuses it."""
        grads = self._grads()
        scale = 1.0
        if self.grad_scaler is not None:
            scale = self.grad_scaler.scale
            if grads:
                torch._foreach_mul_(grads, 1.0 / scale)
                finite = torch.stack([g.isfinite().all() for g in grads]).all()
            else:
                finite = torch.tensor(True, device=device.current_device())
            # Every rank must skip together: any rank's overflow counts.
            found_inf = self._all_reduce((~finite).float().reshape(1), op=dist.ReduceOp.MAX)
            if found_inf.item() > 0:
                result = StepResult(grad_norm=float("nan"), skipped=True, loss_scale=scale)
                self._prepared = (grads, result)
                return result
        sq = self._all_reduce(_sum_of_squares([g for g, c in zip(grads, self.counts, strict=True) if c]))
        if self.expert_norm_group is not None:
            expert_sq = _sum_of_squares([g for g, e in zip(grads, self.is_expert, strict=True) if e])
            if dist.get_world_size(self.expert_norm_group) > 1:
                dist.all_reduce(expert_sq, group=self.expert_norm_group)
            sq = sq + expert_sq
        result = StepResult(grad_norm=math.sqrt(float(sq)), loss_scale=scale)
        self._prepared = (grads, result)
        return result

    @torch.no_grad()
    def step(self) -> StepResult:
        if self._prepared is None:
            self.prepare()
        (grads, result), self._prepared = self._prepared, None
        if self.grad_scaler is not None:
            self.grad_scaler.update(result.skipped)
        if result.skipped:
            return result
        norm, scale = result.grad_norm, result.loss_scale
        clip_grads_(grads, self.spec.clip_grad, norm)
        for m, g in zip(self.main_params, grads, strict=True):
            m.grad = g
        self.inner.step()
        for view, m, copy in zip(self.param_views, self.main_params, self.needs_copy_back, strict=True):
            m.grad = None
            if copy:
                view.copy_(m)
        for chunk in self.chunks:
            chunk.gather_params()
        return StepResult(grad_norm=norm, loss_scale=scale)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for optimizer state: fp32 masters that are copies, Adam moments."""
        masters = sum(m.numel() * 4 for m, c in zip(self.main_params, self.needs_copy_back, strict=True) if c)
        moments = adam_state.moment_bytes(self.inner)
        held = [c.memory_bytes() for c in self.chunks]
        return {
            "master_params": masters,
            "adam_moments": moments,
            "grad_buffer": sum(h["grad_buffer"] for h in held),
            "model_params": sum(h["model_params"] for h in held),
        }

    # ------------------------------------------------------------ state, for checkpoints
    # What a checkpoint part may know of the optimizer (engine/checkpointing: state.py,
    # local_shards.py): `segments` (read only: (param, lo, hi) per segment this rank steps, in the
    # order of every accessor's `i`), each segment's state by name, Adam's step count, and a way
    # to put a segment's state back. Nothing else of its fields is read from outside.

    def has_master_copies(self) -> bool:
        """Whether any master is a copy of its parameter (bf16 / fp16 models): only then is it state
        of its own, saved beside the weights."""
        return any(self.needs_copy_back)

    def state_names(self, i: int) -> tuple[str, ...]:
        """The state segment `i` holds that is not its parameter's: its master when that is a copy,
        then Adam's moments."""
        return ("master", *adam_state.MOMENTS) if self.needs_copy_back[i] else adam_state.MOMENTS

    def segment_state(self, i: int, name: str) -> torch.Tensor:
        """Segment `i`'s "master" (fp32, flat; a view of the parameter itself when that is fp32) or
        Adam's moment `name` (zeros before the first step). The tensors themselves: no copy."""
        main = self.main_params[i]
        return main if name == "master" else adam_state.moment(self.inner, main, name)

    def segment_param(self, i: int) -> torch.Tensor:
        """Segment `i`'s parameter values (flat, the model's dtype): a slice of the parameter, or
        of its bucket's persistent shard when parameters are sharded. The tensor itself."""
        return self.param_views[i]

    def adam_step(self) -> int:
        """Adam's step count (0 before the first step)."""
        return adam_state.step_count(self.inner)

    @torch.no_grad()
    def load_segment_state(self, i: int, step: int, state: Mapping[str, torch.Tensor]) -> None:
        """Put segment `i`'s state back as a checkpoint gives it: Adam's `step` and both moments
        (kept as they are: the caller hands over tensors of the segment's shape), and "master",
        copied into the master when that is a copy (a master that is the parameter is restored with
        the model; one loaded in place, the master itself, needs no copy)."""
        main = self.main_params[i]
        master = state.get("master")
        if master is not None and self.needs_copy_back[i] and master is not main:
            main.copy_(master)
        adam_state.set_state(self.inner, main, step, {name: state[name] for name in adam_state.MOMENTS})
