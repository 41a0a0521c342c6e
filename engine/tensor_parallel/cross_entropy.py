"""Cross entropy over logits split by vocabulary across TP ranks.

The full [tokens, vocab] logits never exist on one rank: three all-reduces over the TP group
(max logit, the target's logit, the sum of exponentials) give the exact loss, and the backward
is softmax minus one-hot on each rank's own vocabulary slice. Computed in fp32 whatever the
logits' dtype. With one TP rank it is torch's own fused cross entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine import parallel_state as ps

IGNORE_INDEX = -100  # torch's default ignore_index, which the TP=1 path relies on


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        ignored = target == IGNORE_INDEX
        target = target.masked_fill(ignored, 0)  # any valid id: the loss and grad are zeroed below
        logits = logits.float()
        max_logit = logits.amax(dim=-1)
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        logits = logits - max_logit.unsqueeze(-1)

        rank, per_rank = dist.get_rank(group), logits.shape[-1]
        start = rank * per_rank
        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)

        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = (sum_exp.log() - target_logit).masked_fill_(ignored, 0.0)

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()
        onehot = torch.zeros_like(grad).scatter_(-1, local_target.unsqueeze(-1), 1.0)
        grad.sub_(onehot * (~outside).unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token loss [...] for logits [..., vocab/tp] and integer targets [...] (global ids).

    A target of IGNORE_INDEX (-100) gives a loss of 0 and no gradient, on any TP size.
    """
    tp = ps.get_tensor_model_parallel_world_size() if group is None else dist.get_world_size(group)
    if tp == 1:
        flat = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            target.reshape(-1),
            reduction="none",
            ignore_index=IGNORE_INDEX,
        )
        return flat.view(target.shape)
    group = group if group is not None else ps.get_tensor_model_parallel_group()
    return _VocabParallelCrossEntropy.apply(logits, target, group)
