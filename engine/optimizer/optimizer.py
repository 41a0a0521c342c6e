"""The training optimizer: AdamW over fp32 master weights, with global grad-norm clipping.

With bf16 model parameters the optimizer keeps an fp32 master copy of each parameter and steps
that, then copies the result back into the bf16 model: small updates are not rounded away.
Weight decay applies to matrices only (not to biases and norm weights), as in Megatron-Core;
the scheduler sets the decay per group through `wd_mult`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.jobspec import OptimizerSpec
from engine.optimizer.clip_grads import clip_grads_, counts_in_norm, global_grad_norm

_SHARD_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "global_shape")


class TrainingOptimizer:
    def __init__(self, model: nn.Module, spec: OptimizerSpec):
        self.spec = spec
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.use_master = any(p.dtype != torch.float32 for p in self.model_params)
        if self.use_master:
            self.main_params = []
            for p in self.model_params:
                main = nn.Parameter(p.detach().float().clone())
                for attr in _SHARD_ATTRS:
                    if hasattr(p, attr):
                        setattr(main, attr, getattr(p, attr))
                self.main_params.append(main)
        else:
            self.main_params = self.model_params
        decay = [m for m in self.main_params if m.dim() > 1]
        no_decay = [m for m in self.main_params if m.dim() <= 1]
        groups = [
            {"params": decay, "wd_mult": 1.0},
            {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0},
        ]
        self.inner = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=spec.lr,
            betas=(spec.adam_beta1, spec.adam_beta2),
            eps=spec.adam_eps,
            weight_decay=spec.weight_decay,
            foreach=True,
        )

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        if self.use_master:
            for m in self.main_params:
                m.grad = None

    @torch.no_grad()
    def step(self) -> float:
        """Clip and apply the accumulated (already reduced) gradients; returns the pre-clip norm."""
        if self.use_master:
            for p, m in zip(self.model_params, self.main_params, strict=True):
                m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
        grads = [m.grad for m in self.main_params if m.grad is not None]
        norm = global_grad_norm(
            [m.grad for m in self.main_params if m.grad is not None and counts_in_norm(m)]
        )
        clip_grads_(grads, self.spec.clip_grad, norm)
        self.inner.step()
        if self.use_master:
            torch._foreach_copy_(self.model_params, self.main_params)
        return norm

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
