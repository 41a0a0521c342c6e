"""Data parallelism: gradients in contiguous buckets, each reduced as soon as backward is done with it.

Every parameter's gradient has a place in a flat buffer, planned by bucket_plan.py (a pure
function of the parameters' sizes and placements, the bucket size and the group sizes). A bucket
is reduced (averaged over the data-parallel group) the moment every parameter in it has seen its
last backward of the step, while backward carries on with earlier layers. "Last" is counted, not
signalled: the step announces how many backward passes each parameter will see (one per
microbatch), so the same mechanism works for the plain loop and for any pipeline schedule, with
no no_sync bookkeeping.

What is sharded, and how gradients are reduced and parameters shared, is the sharding level:
one row of the table in sharding.py (`none`, ZeRO-1 `optim`, ZeRO-2 `optim_grads`, ZeRO-3/FSDP
`optim_grads_params`), whose two strategy objects this class delegates to. Buckets are padded to
a multiple of their group's size, and each rank of the group owns one slice (its shard). MoE
expert parameters get buckets of their own, sharded over the expert data-parallel group instead
(the ranks holding the same experts: Megatron-Core's expert_data_parallel group), so at every
level an expert's gradient, optimizer state and (optim_grads_params) parameters are split 1/edp
like the dense ones are 1/dp; under HSDP experts shard over the whole expert-DP group (their
replicas span nodes anyway when EP fills a node). Hybrid sharding (HSDP): given a `shard_group`
(d ranks of the DP group) and a `replica_group`, dense buckets are sharded over the former and
the reduced shards all-reduced over the latter. A tied embedding split across pipeline stages
gets a bucket of its own so its shard ranges line up on the first and last stage.

Checkpoints read this class only through `checkpoint_view()` (state_view.py): which ranks hold
each parameter and its optimizer state alike, the persistent shards and this rank's flat range of
each parameter in them, and how to refresh parameters after a load.

A model built on the meta device (`deferred`, deferred_init.py) gets its parameters here, each
materialised and initialised where the level keeps it, so it is never whole on a rank when the
level shards parameters.

Written here rather than with torch's DDP/FSDP2 because the buffer is shared with the optimizer
(ZeRO-1 shards are views of it) and with pipeline schedules that call backward themselves; the
FSDP2 decision is in param_gather.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.distributed.bucket import Bucket
from engine.distributed.bucket_plan import ROOT_UNIT, BucketPlan, ParamSlot, Segment, plan_buckets
from engine.distributed.deferred_init import DeferredInit
from engine.distributed.param_gather import ParamGatherer, Unit
from engine.distributed.sharding import LEVELS, SHARDING_LEVELS
from engine.distributed.state_view import CheckpointView
from engine.parallel_placement import placement_of


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
        deferred: DeferredInit | None = None,
    ):
        """`sharding`: one of SHARDING_LEVELS (default "optim" when `shard`, else "none").
        `deferred`: the module was built with its parameters on the meta device
        (deferred_init.py); each is materialised where this level keeps it, and filled there."""
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
        self.overlap = overlap
        self.grad_dtype = grad_dtype
        params = [p for p in module.parameters() if p.requires_grad]
        placements = [placement_of(p) for p in params]
        level = LEVELS[sharding]
        # Where one shard rank holds everything (no DP and no expert DP) there is nothing to
        # free: parameters stay whole, as under optim_grads.
        experts = any(pl.expert for pl in placements)
        if level.shards_params and not (self.sdp > 1 or (experts and self.edp > 1)):
            level = LEVELS["optim_grads"]
        self.level = level
        layers = list(module.fsdp_units()) if level.shards_params and hasattr(module, "fsdp_units") else []
        unit_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
        slots = [
            ParamSlot(p.numel(), pl.expert, pl.tied_embedding, unit_of.get(id(p)))
            for p, pl in zip(params, placements, strict=True)
        ]
        self.plan = plan_buckets(
            slots, bucket_size, world=self.sdp, expert_world=self.edp, units=len(layers) if level.shards_params else None
        )
        self.trainable_params = params  # every parameter with a gradient, in registration order
        self.buckets = [self._bucket(b, params) for b in self.plan.buckets]
        self._slot = {id(p): (b, s) for b in self.buckets for p, s in zip(b.params, b.plan.segments, strict=True)}
        if level.shards_params:
            units, root = [Unit(index=i) for i in range(len(layers))], Unit(index=-1)
            for bucket in self.buckets:
                bucket.unit = root if bucket.plan.unit == ROOT_UNIT else units[bucket.plan.unit]
                bucket.unit.buckets.append(bucket)
            self.units = (units, root, layers)
        self.deferred = deferred
        device = deferred.device if deferred is not None else params[0].device
        # Parameters first: built on the meta device, they get their storage here.
        self.param_home = level.params()
        self.param_home.attach(self, params[0].dtype, device)
        self.grad_sync = level.grads()
        self.grad_buffer = torch.zeros(self.grad_sync.buffer_numel(self.buckets), dtype=grad_dtype, device=device)
        self.grad_sync.attach(self, self.grad_buffer)
        self.expected_backwards = 1
        self._view: CheckpointView | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _bucket(self, plan: BucketPlan, params: list[nn.Parameter]) -> Bucket:
        members = [params[s.param] for s in plan.segments]
        if plan.expert:
            return Bucket(plan, members, group=self.expert_group, rank=self.edp_rank)
        return Bucket(plan, members, group=self.shard_group, rank=self.sdp_rank, replica_group=self.replica_group)

    # What the level shards (read by the optimizer, grad finalisation, benches).
    @property
    def shard(self) -> bool:
        """The optimizer state is sharded (every level but `none`)."""
        return self.level.shards_optimizer

    @property
    def shard_grads(self) -> bool:
        return self.level.shards_grads

    @property
    def shard_params(self) -> bool:
        return self.level.shards_params

    @property
    def gatherer(self) -> ParamGatherer | None:
        return self.param_home.gatherer

    def bucket_for(self, param: nn.Parameter) -> Bucket:
        return self._slot[id(param)][0]

    def segment_for(self, param: nn.Parameter) -> Segment:
        """Where `param` sits in the whole buffer (bucket_plan.Segment)."""
        return self._slot[id(param)][1]

    def needs_sync(self, bucket: Bucket) -> bool:
        return self.dp > 1 or (bucket.expert and self.edp > 1)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def start_step(self, expected_backwards: int) -> None:
        """Zero the gradients; each parameter will see `expected_backwards` backward passes."""
        self.grad_buffer.zero_()
        self.expected_backwards = expected_backwards
        self.grad_sync.start_step(self)

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self.grad_sync.on_ready(self, param)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Launch what backward did not (overlap off, unused params) and wait for every bucket."""
        self.grad_sync.finish(self)
        self.param_home.after_backward()

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the optimizer step: every rank updated its shard of each bucket; share them
        (distributed optimizer), or drop the gathered copies, now stale (sharded parameters:
        each use gathers the new shards)."""
        self.param_home.after_step(self)

    def _segments(self) -> list[tuple[nn.Parameter, int, int, Bucket, int]]:
        """(param, lo, hi, bucket, offset of lo in the bucket's shard) for what this rank owns."""
        owned = self.plan.owned(self.sdp_rank, self.edp_rank, sharded=self.shard)
        return [(self.trainable_params[o.param], o.lo, o.hi, self.buckets[o.bucket], o.shard_offset) for o in owned]

    def param_shard_ranges(self) -> list[tuple[nn.Parameter, int, int]]:
        """(param, lo, hi): the flat element range of each param this DP rank owns (all of
        every param without the distributed optimizer)."""
        return [(p, lo, hi) for p, lo, hi, _, _ in self._segments()]

    def param_views(self) -> list[torch.Tensor]:
        """Per param_shard_ranges segment, the memory holding its values: a slice of the
        parameter, or of the bucket's persistent shard when parameters are sharded."""
        return [self.param_home.view(b, p, lo, hi, o) for p, lo, hi, b, o in self._segments()]

    def grad_views(self) -> list[torch.Tensor]:
        """Per param_shard_ranges segment, its reduced gradient (valid after finish_grad_sync)."""
        return [self.grad_sync.view(b, p, lo, hi, o) for p, lo, hi, b, o in self._segments()]

    @torch.no_grad()
    def gather_all_params(self) -> None:
        """Sharded parameters: make every parameter whole (checkpoint save/load, inspection);
        the next step frees them again."""
        self.param_home.gather_all()

    @torch.no_grad()
    def params_loaded(self) -> None:
        """Sharded parameters: whole values were written into the gathered parameters (a
        checkpoint load); copy this rank's slices into the persistent shards."""
        self.param_home.loaded(self)

    @torch.no_grad()
    def unsharded_grads(self) -> dict[int, torch.Tensor]:
        """id(param) -> its whole reduced gradient (a copy; all-gathers sharded gradients: a
        collective over the shard group). For tests and diagnostics."""
        return self.grad_sync.unsharded(self)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this chunk holds now for parameters and gradients (allocated storage)."""
        grads = self.grad_buffer.numel() * self.grad_buffer.element_size()
        return {"grad_buffer": grads, "model_params": self.param_home.memory_bytes(self)}

    def checkpoint_view(self) -> CheckpointView:
        """What checkpoints may know of this chunk (state_view.py); built once: buckets do not change."""
        if self._view is None:
            self._view = CheckpointView.of(self)
        return self._view
