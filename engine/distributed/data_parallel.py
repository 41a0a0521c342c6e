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
brings every rank's parameters up to date. Buckets are padded to a multiple of the shard size
(the DP size, or the HSDP shard group's).
MoE expert parameters get buckets of their own, sharded over the expert data-parallel group
instead (the ranks holding the same experts: Megatron-Core's expert_data_parallel group), so at
every level an expert's gradient, optimizer state and (optim_grads_params) parameters are split
1/edp like the dense ones are 1/dp; under HSDP experts shard over the whole expert-DP group
(their replicas span nodes anyway when EP fills a node). Each bucket carries its group.
Parameters marked `shared_embedding` (a tied embedding split across pipeline stages) get a bucket
of their own so their shard ranges line up on the first and last stage.

With `sharding="optim_grads"` (ZeRO-2) no full gradient is kept: each bucket's gradients of one
microbatch are staged in a transient bucket-sized buffer, reduce-scattered as soon as the last
of them arrives (while backward goes on) and added into a persistent shard-sized buffer, so the
optimizer reads this rank's 1/d straight from there (always during backward: `overlap` does not
apply, as holding a full gradient until the end is what this level avoids; the 1/dp of each
microbatch's reduction adds up to the step's average). `optim_grads_params` (ZeRO-3 / FSDP) also
keeps parameters as shards, one unit of buckets per transformer layer, gathered around each use
by param_gather.py. Hybrid sharding (HSDP): given a `shard_group` (d ranks of the DP group) and
a `replica_group`, buckets are sharded over the former and the reduced shards all-reduced over
the latter.

Written here rather than with torch's DDP/FSDP2 because the buffer is shared with the optimizer
(ZeRO-1 shards are views of it) and with pipeline schedules that call backward themselves; the
FSDP2 decision is in param_gather.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from engine.distributed.collectives import all_gather_into, reduce_scatter_into
from engine.distributed.param_gather import ParamGatherer, Unit
from engine.parallel_placement import placement_of

SHARDING_LEVELS = ("none", "optim", "optim_grads", "optim_grads_params")


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
    # The ranks this bucket is reduced and sharded over (dense: the DP or HSDP shard group;
    # experts: the expert data-parallel group), their number, this rank's place among them, and
    # the HSDP replica group its reduced shards are then summed over (dense only).
    group: object | None = None
    world: int = 1
    rank: int = 0
    replica_group: object | None = None
    launched: bool = False
    # Sharded gradients (optim_grads and up): `grad` is a transient staging buffer (None between
    # microbatches), `grad_shard` this rank's persistent slice of the reduced gradient.
    grad_shard: torch.Tensor | None = None
    round: set[int] = field(default_factory=set)  # params whose grad of this microbatch is staged
    inflight: list = field(default_factory=list)  # (work, reduced shard, staging kept alive)
    # Sharded parameters (optim_grads_params): the persistent shard and the gathered buffer.
    param_shard: torch.Tensor | None = None
    full: torch.Tensor | None = None
    unit: Unit | None = None

    def shard_range(self) -> tuple[int, int]:
        """This rank's slice of the bucket, as offsets into the bucket."""
        size = self.numel // self.world
        return self.rank * size, (self.rank + 1) * size


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
        sharding: str | None = None,
        expert_group: dist.ProcessGroup | None = None,
        shard_group: dist.ProcessGroup | None = None,
        replica_group: dist.ProcessGroup | None = None,
    ):
        """`sharding`: one of SHARDING_LEVELS (default "optim" when `shard`, else "none")."""
        super().__init__()
        sharding = sharding or ("optim" if shard else "none")
        if sharding not in SHARDING_LEVELS:
            raise ValueError(f"sharding must be one of {SHARDING_LEVELS}, not {sharding!r}")
        self.module = module
        self.group = group
        self.dp = dist.get_world_size(group) if group is not None else 1
        self.dp_rank = dist.get_rank(group) if group is not None else 0
        # The ranks a bucket is sharded over: the DP group, or one HSDP shard group of it.
        self.shard_group = shard_group if shard_group is not None else group
        self.sdp = dist.get_world_size(self.shard_group) if self.shard_group is not None else 1
        self.sdp_rank = dist.get_rank(self.shard_group) if self.shard_group is not None else 0
        self.replica_group = replica_group
        self.expert_group = expert_group
        self.edp = dist.get_world_size(expert_group) if expert_group is not None else 1
        self.edp_rank = dist.get_rank(expert_group) if expert_group is not None else 0
        self.sharding = sharding
        self.shard = sharding != "none"  # the optimizer state is sharded
        self.shard_grads = sharding in ("optim_grads", "optim_grads_params")
        self.overlap = overlap
        self.grad_dtype = grad_dtype
        params = [p for p in module.parameters() if p.requires_grad]
        dense = [p for p in params if not placement_of(p).expert]
        experts = [p for p in params if placement_of(p).expert]
        # Where one shard rank holds everything (no DP and no expert DP) there is nothing to
        # free: parameters stay whole.
        self.shard_params = sharding == "optim_grads_params" and (self.sdp > 1 or (bool(experts) and self.edp > 1))
        self.gatherer: ParamGatherer | None = None
        if self.shard_params:
            self.buckets, units, root, layers = self._plan_units(module, dense, experts, bucket_size)
        else:
            self.buckets = self._plan_buckets(dense, bucket_size)
            expert_buckets = self._plan_buckets(experts, bucket_size, expert=True)
            offset = sum(b.numel for b in self.buckets)
            for bucket in expert_buckets:
                bucket.offset += offset
            self.buckets += expert_buckets
        total = sum(b.numel for b in self.buckets)
        device = params[0].device
        # optim_grads and up: the persistent gradient is this rank's shard of every bucket.
        grad_numel = sum(b.numel // b.world for b in self.buckets) if self.shard_grads else total
        self.grad_buffer = torch.zeros(grad_numel, dtype=grad_dtype, device=device)
        whole_params = self.shard and not self.shard_params
        self.param_buffer = torch.zeros(total, dtype=params[0].dtype, device=device) if whole_params else None
        self.bucket_of: dict[int, Bucket] = {}
        self.param_offset: dict[int, int] = {}
        grad_offset = 0
        for bucket in self.buckets:
            if self.shard_grads:
                bucket.grad_shard = self.grad_buffer[grad_offset : grad_offset + bucket.numel // bucket.world]
                grad_offset += bucket.numel // bucket.world
                bucket.grad = None
            else:
                bucket.grad = self.grad_buffer[bucket.offset : bucket.offset + bucket.numel]
            if whole_params:
                bucket.param = self.param_buffer[bucket.offset : bucket.offset + bucket.numel]
            if self.shard_params:
                bucket.full = torch.zeros(bucket.numel, dtype=params[0].dtype, device=device)
            start = bucket.offset
            for p in bucket.params:
                n = p.numel()
                if not self.shard_grads:
                    p.main_grad = self.grad_buffer[start : start + n].view_as(p)
                    if p.dtype == grad_dtype:
                        # autograd accumulates straight into the buffer: no copy per microbatch
                        p.grad = p.main_grad
                if whole_params or self.shard_params:
                    home = bucket.param if whole_params else bucket.full
                    view = home[start - bucket.offset : start - bucket.offset + n].view_as(p)
                    view.copy_(p.data)
                    p.data = view
                self.bucket_of[id(p)] = bucket
                self.param_offset[id(p)] = start
                start += n
            if self.shard_params:
                lo, hi = bucket.shard_range()
                bucket.param_shard = bucket.full[lo:hi].clone()
        if self.shard_params:
            self.gatherer = ParamGatherer(module, units, root, layers)
            for unit in [*units, root]:  # free_all frees gathered units only
                for b in unit.buckets:
                    b.full.untyped_storage().resize_(0)
        self.expected_backwards = 1
        self._seen: dict[int, int] = {}
        self._rounds_done: dict[int, int] = {}  # per unit: buckets reduced this microbatch
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _plan_units(
        self, module: nn.Module, dense: list[nn.Parameter], experts: list[nn.Parameter], bucket_size: int
    ):
        """ZeRO-3: buckets that never span two units (a unit is gathered whole): each layer of
        `module.fsdp_units()` is one, the rest of the model is the root (the MTP depths, with
        their experts, among it). Experts are buckets of their unit, sharded over the expert
        data-parallel group."""
        layers = list(module.fsdp_units()) if hasattr(module, "fsdp_units") else []
        wanted = {id(p) for p in dense} | {id(p) for p in experts}
        owner: dict[int, int] = {}
        for i, layer in enumerate(layers):
            for p in layer.parameters():
                owner[id(p)] = i
        units = [Unit(index=i) for i in range(len(layers))]
        root = Unit(index=-1)
        rest = [p for p in [*dense, *experts] if id(p) not in owner]
        groups: list[tuple[Unit, list[nn.Parameter]]] = [(root, rest)]
        groups += [
            (units[i], [p for p in layer.parameters() if id(p) in wanted]) for i, layer in enumerate(layers)
        ]
        buckets, offset = [], 0
        for unit, unit_params in reversed(groups):  # backward order, like _plan_buckets
            unit_dense = [p for p in unit_params if not placement_of(p).expert]
            unit_experts = [p for p in unit_params if placement_of(p).expert]
            planned = self._plan_buckets(unit_experts, bucket_size, expert=True)
            planned += self._plan_buckets(unit_dense, bucket_size)
            for bucket in planned:
                bucket.unit = unit
                bucket.offset = offset  # _plan_buckets' offsets start at 0 in each call
                offset += bucket.numel
                unit.buckets.append(bucket)
                buckets.append(bucket)
        return buckets, units, root, layers

    def _plan_buckets(self, params: list[nn.Parameter], bucket_size: int, expert: bool = False) -> list[Bucket]:
        """Reverse registration order approximates backward order: the first bucket fills first."""
        buckets, current, offset = [], [], 0
        if expert:
            where = dict(group=self.expert_group, world=self.edp, rank=self.edp_rank, expert=True)
        else:
            where = dict(group=self.shard_group, world=self.sdp, rank=self.sdp_rank, replica_group=self.replica_group)

        def close(group: list[nn.Parameter]) -> None:
            nonlocal offset
            if not group:
                return
            n = sum(p.numel() for p in group)
            padded = -(-n // where["world"]) * where["world"]
            buckets.append(Bucket(params=list(group), offset=offset, numel=padded, grad=torch.empty(0), **where))
            offset += padded

        for p in reversed(params):
            if placement_of(p).tied_embedding:
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
            if self.shard_grads:
                bucket.grad, bucket.round, bucket.inflight = None, set(), []
        self._rounds_done = {}

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if self.shard_grads:
            self._stage(param)
            return
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

    def _stage(self, param: nn.Parameter) -> None:
        """Sharded gradients: copy this microbatch's grad into the bucket's staging buffer; once
        every param of the bucket has its grad of the microbatch, reduce-scatter it (a round)."""
        key, bucket = id(param), self.bucket_of[id(param)]
        if key in bucket.round:  # a second backward before the bucket's other params had theirs
            self._launch_round(bucket)
        if bucket.grad is None:
            bucket.grad = torch.zeros(bucket.numel, dtype=self.grad_dtype, device=self.grad_buffer.device)
        start = self.param_offset[key] - bucket.offset
        bucket.grad[start : start + param.numel()].view_as(param).copy_(param.grad)
        param.grad = None
        bucket.round.add(key)
        if len(bucket.round) == len(bucket.params):
            self._launch_round(bucket)

    def _launch_round(self, bucket: Bucket) -> None:
        staged, bucket.grad, bucket.round = bucket.grad, None, set()
        self._drain(bucket)  # at most one round of a bucket in flight: bounded staging memory
        if self.dp > 1:
            staged.mul_(1.0 / self.dp)  # averaged over DP (see _launch)
        if bucket.world > 1:
            out = torch.empty(bucket.numel // bucket.world, dtype=staged.dtype, device=staged.device)
            work = reduce_scatter_into(out, staged, group=bucket.group, async_op=True)
            bucket.inflight.append((work, out, staged))
        else:
            bucket.inflight.append((None, staged, None))
        unit = bucket.unit
        if unit is not None and self.gatherer is not None:
            done = self._rounds_done.get(id(unit), 0) + 1
            if done == len(unit.buckets):  # the unit's backward of this microbatch is over
                done = 0
                self.gatherer.free(unit)
            self._rounds_done[id(unit)] = done

    def _drain(self, bucket: Bucket) -> None:
        for work, out, _ in bucket.inflight:
            if work is not None:
                work.wait()
            if bucket.replica_group is not None:
                dist.all_reduce(out, group=bucket.replica_group)
            bucket.grad_shard.add_(out)
        bucket.inflight = []

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
        if bucket.world == 1 and bucket.replica_group is None:
            bucket.work = None  # an expert on one expert-DP rank: nothing to sum with
        elif self.shard:
            bucket.shard_out = torch.empty(
                bucket.numel // bucket.world, dtype=bucket.grad.dtype, device=bucket.grad.device
            )
            bucket.work = reduce_scatter_into(bucket.shard_out, bucket.grad, group=bucket.group, async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.grad, group=bucket.group if bucket.expert else self.group, async_op=True)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Launch what backward did not (overlap off, unused params) and wait for every bucket."""
        if self.shard_grads:
            for bucket in self.buckets:
                if bucket.grad is not None:
                    self._launch_round(bucket)
            for bucket in self.buckets:
                self._drain(bucket)
            if self.gatherer is not None:
                self.gatherer.free_all()
            return
        for bucket in self.buckets:
            if not bucket.launched and self._needs_sync(bucket):
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            if bucket.shard_out is not None:
                if bucket.replica_group is not None:
                    dist.all_reduce(bucket.shard_out, group=bucket.replica_group)
                lo, hi = bucket.shard_range()
                bucket.grad[lo:hi].copy_(bucket.shard_out)
                bucket.shard_out = None

    @torch.no_grad()
    def gather_params(self) -> None:
        """Distributed optimizer: every DP rank updated its slice of each bucket; share them.
        Sharded parameters: drop any gathered copy, now stale; each use gathers the new shards."""
        if self.gatherer is not None:
            self.gatherer.free_all()
            return
        if not self.shard:
            return
        works = []
        for bucket in self.buckets:
            if bucket.world == 1:  # this rank updated all of it
                continue
            lo, hi = bucket.shard_range()
            mine = bucket.param[lo:hi].clone()
            works.append(all_gather_into(bucket.param, mine, group=bucket.group, async_op=True))
        for w in works:
            w.wait()

    def _segments(self) -> list[tuple[nn.Parameter, int, int, Bucket, int]]:
        """(param, lo, hi, bucket, offset of lo in the bucket's shard) for what this rank owns."""
        out = []
        for bucket in self.buckets:
            if not self.shard:
                out.extend((p, 0, p.numel(), bucket, 0) for p in bucket.params)
                continue
            b_lo, b_hi = bucket.shard_range()
            lo_abs, hi_abs = bucket.offset + b_lo, bucket.offset + b_hi
            for p in bucket.params:
                start = self.param_offset[id(p)]
                lo, hi = max(start, lo_abs), min(start + p.numel(), hi_abs)
                if lo < hi:
                    out.append((p, lo - start, hi - start, bucket, lo - lo_abs))
        return out

    def param_shard_ranges(self) -> list[tuple[nn.Parameter, int, int]]:
        """(param, lo, hi): the flat element range of each param this DP rank owns (all of
        every param without the distributed optimizer)."""
        return [(p, lo, hi) for p, lo, hi, _, _ in self._segments()]

    def param_views(self) -> list[torch.Tensor]:
        """Per param_shard_ranges segment, the memory holding its values: a slice of the
        parameter, or of the bucket's persistent shard when parameters are sharded."""
        return [
            b.param_shard[o : o + hi - lo] if self.shard_params else p.detach().view(-1)[lo:hi]
            for p, lo, hi, b, o in self._segments()
        ]

    def grad_views(self) -> list[torch.Tensor]:
        """Per param_shard_ranges segment, its reduced gradient (valid after finish_grad_sync)."""
        return [
            b.grad_shard[o : o + hi - lo] if self.shard_grads else p.main_grad.view(-1)[lo:hi]
            for p, lo, hi, b, o in self._segments()
        ]

    @torch.no_grad()
    def gather_all_params(self) -> None:
        """Sharded parameters: make every parameter whole (checkpoint save/load, inspection);
        the next step frees them again."""
        if self.gatherer is not None:
            self.gatherer.gather_all()

    @torch.no_grad()
    def params_loaded(self) -> None:
        """Sharded parameters: whole values were written into the gathered parameters (a
        checkpoint load); copy this rank's slices into the persistent shards."""
        if self.gatherer is None:
            return
        for bucket in self.buckets:
            lo, hi = bucket.shard_range()
            bucket.param_shard.copy_(bucket.full[lo:hi])

    @torch.no_grad()
    def unsharded_grads(self) -> dict[int, torch.Tensor]:
        """id(param) -> its whole reduced gradient (a copy; all-gathers sharded gradients: a
        collective over the shard group). For tests and diagnostics."""
        if not self.shard_grads:
            return {id(p): p.main_grad.detach().clone() for b in self.buckets for p in b.params}
        out = {}
        for bucket in self.buckets:
            full = torch.empty(bucket.numel, dtype=bucket.grad_shard.dtype, device=bucket.grad_shard.device)
            if bucket.world > 1:
                all_gather_into(full, bucket.grad_shard.clone(), group=bucket.group)
            else:
                full.copy_(bucket.grad_shard)
            for p in bucket.params:
                start = self.param_offset[id(p)] - bucket.offset
                out[id(p)] = full[start : start + p.numel()].view(p.shape).clone()
        return out

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this chunk holds now for parameters and gradients (allocated storage)."""
        grads = self.grad_buffer.numel() * self.grad_buffer.element_size()
        if self.shard_params:
            params = sum(
                b.param_shard.numel() * b.param_shard.element_size() + b.full.untyped_storage().nbytes()
                for b in self.buckets
            )
        else:
            params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        return {"grad_buffer": grads, "model_params": params}
