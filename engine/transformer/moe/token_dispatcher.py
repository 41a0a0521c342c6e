"""Send each token copy to the rank that holds its expert and bring the results back.

The all-to-all dispatcher of Megatron-Core, for expert tensor parallel size 1:
  permute    sort this rank's (token, expert) assignments by expert: [N, h]
  all-to-all rows for experts on EP rank j go to rank j (split sizes exchanged first)
  regroup    received rows arrive ordered by (source rank, local expert); the experts want them
             by (local expert, source rank)
  ... local experts run ...
  and the same steps backwards; `unpermute` scales each result by its gate and sums a token's
  k results into its row.
The all-to-all is an autograd function (backward is the reverse all-to-all), so gradients flow
to the tokens on the ranks that sent them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class AllToAllTime:
    """Seconds this process spent inside the token all-to-alls (forward and backward), for the
    expert-parallel benchmark's communication share. A clock read per call: negligible."""

    seconds = 0.0

    @classmethod
    def timed(cls, *args, **kwargs) -> None:
        start = time.perf_counter()
        dist.all_to_all_single(*args, **kwargs)
        cls.seconds += time.perf_counter() - start


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        AllToAllTime.timed(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        AllToAllTime.timed(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _regroup(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows in blocks of counts[a, b] (a-major) -> the same blocks b-major."""
    blocks = rows.split(counts.reshape(-1).tolist())
    a, b = counts.shape
    return torch.cat([blocks[i * b + j] for j in range(b) for i in range(a)]) if rows.numel() else rows


class AllToAllDispatcher:
    """One dispatch/combine per MoE layer forward; holds the bookkeeping in between."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None):
        self.num_experts = num_experts
        self.group = ep_group
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.local_experts = num_experts // self.ep

    def dispatch(
        self, x: torch.Tensor, indices: torch.Tensor, kept: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """x [T, h] -> (rows for this rank's local experts, grouped by expert; rows per expert)."""
        k = indices.shape[1]
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)[kept.reshape(-1)]
        expert = indices.reshape(-1)[kept.reshape(-1)]
        order = torch.argsort(expert, stable=True)
        self._token, self._order = token[order], order
        permuted = x[self._token]
        counts = torch.bincount(expert, minlength=self.num_experts)
        if self.ep == 1:
            self._recv = None
            return permuted, counts.tolist()
        send = counts.view(self.ep, self.local_experts)  # [dest rank, local expert]
        recv = torch.empty_like(send)
        AllToAllTime.timed(recv, send.contiguous(), group=self.group)  # [source rank, local expert]
        self._send, self._recv = send, recv
        received = all_to_all(permuted, recv.sum(1).tolist(), send.sum(1).tolist(), self.group)
        return _regroup(received, recv), recv.sum(0).tolist()

    def combine(
        self, y: torch.Tensor, gates: torch.Tensor, kept: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        """Expert outputs (as dispatch returned them) -> [T, h], each token's results weighted by
        its gates and summed."""
        if self._recv is not None:
            back = _regroup(y, self._recv.t())  # (local expert, source) -> (source, local expert)
            y = all_to_all(back, self._send.sum(1).tolist(), self._recv.sum(1).tolist(), self.group)
        weights = gates.reshape(-1)[kept.reshape(-1)][self._order].unsqueeze(1).to(y.dtype)
        out = y.new_zeros((num_tokens, y.shape[1]))
        return out.index_add(0, self._token, y * weights)
