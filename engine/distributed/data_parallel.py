"""Data parallelism: gradients in contiguous buckets, each reduced as soon as backward is done with it.

Every parameter's gradient lives in one flat buffer (`param.main_grad` is a view into it), in
fp32 when `grad_reduce_in_fp32` even for bf16/fp16 params, so microbatches accumulate without
rounding. When the param has the buffer's dtype, `param.grad` is that same view and autograd
accumulates into the buffer in place (torch DDP's gradient_as_bucket_view); otherwise a
post-accumulate-grad hook adds each microbatch's grad into `main_grad` and frees it. A bucket is reduced (averaged over the data-parallel group) the moment every
parameter in it has seen its last backward of the step, while backward carries on with earlier
layers. "Last" is counted, not signalled: the step announces how many backward passes each
parameter will see (one per microbatch), so the same mechanism works for the plain loop and for
any pipeline schedule, with no no_sync bookkeeping.

With the distributed optimizer (ZeRO-1) each bucket is reduce-scattered instead of all-reduced:
data-parallel rank r gets the summed gradient of its 1/dp of every bucket, and parameters also
live in a flat buffer so that, after each rank has updated its slice, one all-gather per bucket
brings every rank's parameters up to date. Buckets are padded to a multiple of the DP size.
Parameters marked `shared_embedding` (a tied embedding split across pipeline stages) get a bucket
of their own so their shard ranges line up on the first and last stage.

Written here rather than with torch's DDP/FSDP2 because the buffer is shared with the optimizer
(ZeRO-1 shards are views of it) and with pipeline schedules that call backward themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from engine.distributed.collectives import all_gather_into, reduce_scatter_into


@dataclass
class Bucket:
    params: list[nn.Parameter]
    offset: int
    numel: int  # padded to a multiple of the DP size
    grad: torch.Tensor  # view of the grad buffer
    param: torch.Tensor | None = None  # view of the param buffer (distributed optimizer only)
    pending: set[int] = field(default_factory=set)
    work: object | None = None
    shard_out: torch.Tensor | None = None
    expert: bool = False  # MoE expert params: reduced over the expert data-parallel group
    launched: bool = False

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """This DP rank's slice of the bucket, as offsets into the bucket."""
        size = self.numel // world
        return rank * size, (rank + 1) * size


class DataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None,
        *,
        grad_dtype: torch.dtype = torch.float32,
        bucket_size: int = 40_000_000,
        overlap: bool = True,
        shard: bool = False,
        expert_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.module = module
        self.group = group
        self.dp = dist.get_world_size(group) if group is not None else 1
        self.dp_rank = dist.get_rank(group) if group is not None else 0
        self.expert_group = expert_group
        self.edp = dist.get_world_size(expert_group) if expert_group is not None else 1
        self.overlap, self.shard = overlap, shard
        params = [p for p in module.parameters() if p.requires_grad]
        dense = [p for p in params if not getattr(p, "expert", False)]
        experts = [p for p in params if getattr(p, "expert", False)]
        self.buckets = self._plan_buckets(dense, bucket_size)
        if experts:
            if shard:
                raise ValueError("the distributed optimizer does not shard MoE expert parameters yet")
            offset = sum(b.numel for b in self.buckets)
            for bucket in self._plan_buckets(experts, bucket_size):
                bucket.offset += offset
                bucket.expert = True
                self.buckets.append(bucket)
        total = sum(b.numel for b in self.buckets)
        device = params[0].device
        self.grad_buffer = torch.zeros(total, dtype=grad_dtype, device=device)
        self.param_buffer = torch.zeros(total, dtype=params[0].dtype, device=device) if shard else None
        self.bucket_of: dict[int, Bucket] = {}
        self.param_offset: dict[int, int] = {}
        for bucket in self.buckets:
            bucket.grad = self.grad_buffer[bucket.offset : bucket.offset + bucket.numel]
            if shard:
                bucket.param = self.param_buffer[bucket.offset : bucket.offset + bucket.numel]
            start = bucket.offset
            for p in bucket.params:
                n = p.numel()
                p.main_grad = self.grad_buffer[start : start + n].view_as(p)
                if p.dtype == grad_dtype:
                    # autograd accumulates straight into the buffer: no copy per microbatch
                    p.grad = p.main_grad
                if shard:
                    view = self.param_buffer[start : start + n].view_as(p)
                    view.copy_(p.data)
                    p.data = view
                self.bucket_of[id(p)] = bucket
                self.param_offset[id(p)] = start
                start += n
        self.expected_backwards = 1
        self._seen: dict[int, int] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _plan_buckets(self, params: list[nn.Parameter], bucket_size: int) -> list[Bucket]:
        """Reverse registration order approximates backward order: the first bucket fills first."""
        buckets, current, offset = [], [], 0

        def close(group: list[nn.Parameter]) -> None:
            nonlocal offset
            if not group:
                return
            n = sum(p.numel() for p in group)
            padded = -(-n // self.dp) * self.dp
            buckets.append(Bucket(params=list(group), offset=offset, numel=padded, grad=torch.empty(0)))
            offset += padded

        for p in reversed(params):
            if getattr(p, "shared_embedding", False):
                close(current)
                current = []
                close([p])
                continue
            current.append(p)
            if sum(q.numel() for q in current) >= bucket_size:
                close(current)
                current = []
        close(current)
        return buckets

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def start_step(self, expected_backwards: int) -> None:
        """Zero the gradients; each parameter will see `expected_backwards` backward passes."""
        self.grad_buffer.zero_()
        self.expected_backwards = expected_backwards
        self._seen.clear()
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}
            bucket.work = None
            bucket.shard_out = None
            bucket.launched = False

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is not None and param.grad.data_ptr() != param.main_grad.data_ptr():
            param.main_grad.add_(param.grad)  # other dtype, or someone reset .grad
            param.grad = param.main_grad if param.dtype == param.main_grad.dtype else None
        key = id(param)
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] == self.expected_backwards:
            bucket = self.bucket_of[key]
            bucket.pending.discard(key)
            if self.overlap and not bucket.pending:
                self._launch(bucket)

    def _needs_sync(self, bucket: Bucket) -> bool:
        return self.dp > 1 or (bucket.expert and self.edp > 1)

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        if not self._needs_sync(bucket):
            bucket.work = None
            return
        # The loss is a mean over this DP rank's samples, so grads average over DP. An expert saw
        # tokens from every rank of its EP group, each scaled by its own rank's 1/samples: the
        # same 1/dp, then a sum over the expert-DP replicas.
        bucket.grad.mul_(1.0 / self.dp)
        if bucket.expert:
            if self.edp > 1:
                bucket.work = dist.all_reduce(bucket.grad, group=self.expert_group, async_op=True)
            return
        if self.shard:
            bucket.shard_out = torch.empty(
                bucket.numel // self.dp, dtype=bucket.grad.dtype, device=bucket.grad.device
            )
            bucket.work = reduce_scatter_into(bucket.shard_out, bucket.grad, group=self.group, async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.grad, group=self.group, async_op=True)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Launch what backward did not (overlap off, unused params) and wait for every bucket."""
        for bucket in self.buckets:
            if not bucket.launched and self._needs_sync(bucket):
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            if bucket.shard_out is not None:
                lo, hi = bucket.shard_range(self.dp_rank, self.dp)
                bucket.grad[lo:hi].copy_(bucket.shard_out)
                bucket.shard_out = None

    @torch.no_grad()
    def gather_params(self) -> None:
        """Distributed optimizer: every DP rank updated its slice of each bucket; share them."""
        if not self.shard or self.dp == 1:
            return
        works = []
        for bucket in self.buckets:
            lo, hi = bucket.shard_range(self.dp_rank, self.dp)
            mine = bucket.param[lo:hi].clone()
            works.append(all_gather_into(bucket.param, mine, group=self.group, async_op=True))
        for w in works:
            w.wait()

    def param_shard_ranges(self) -> list[tuple[nn.Parameter, int, int]]:
        """(param, lo, hi): the flat element range of each param this DP rank owns (all of
        every param without the distributed optimizer)."""
        out = []
        for bucket in self.buckets:
            if not self.shard:
                out.extend((p, 0, p.numel()) for p in bucket.params)
                continue
            b_lo, b_hi = bucket.shard_range(self.dp_rank, self.dp)
            lo_abs, hi_abs = bucket.offset + b_lo, bucket.offset + b_hi
            for p in bucket.params:
                start = self.param_offset[id(p)]
                lo, hi = max(start, lo_abs), min(start + p.numel(), hi_abs)
                if lo < hi:
                    out.append((p, lo - start, hi - start))
        return out
