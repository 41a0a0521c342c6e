"""Side losses (MoE balancing, multi-token prediction) joined to the graph without changing the
main loss: `attach_loss(out, loss, grad)` returns `out` itself, and in backward gives `loss` the
gradient `grad` (the weight the main loss gets: the fp16 loss scale over microbatches for MoE's
losses, 1 for MTP's, whose weights are already inside). So a pipeline schedule, which only knows
the main loss, backpropagates the side losses through the activation they are attached to, and
the reported loss stays the main one (Megatron-Core's MoEAuxLossAutoScaler / MTPLossAutoScaler).
"""

from __future__ import annotations

import torch


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, grad: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.grad = grad
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_out, torch.full_like(loss, ctx.grad), None


def attach_loss(out: torch.Tensor, loss: torch.Tensor, grad: float = 1.0) -> torch.Tensor:
    return _AttachLoss.apply(out, loss, grad)
