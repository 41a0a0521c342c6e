"""The optimizer's state as this rank holds it, for in-memory snapshots of the same layout.

The persistent checkpoint stores Adam's state parameter-shaped, so that another layout can
load it (state.py: OptimizerState); under the distributed optimizer that means assembling each
parameter's state over its data-parallel group, an all-reduce of the whole model per moment.
Once per checkpoint interval that is affordable; an in-memory snapshot is taken as often as
every step and is only ever restored by the same rank of the same layout, so it keeps the
optimizer's own flat segments instead: no collective and no parameter-sized buffers, and under
ZeRO-1 each rank's bytes are its 1/DP shard. Without the distributed optimizer the segments are
whole parameters that every data-parallel replica holds alike, and `replica_group` says so, so
that a snapshot keeps a 1/DP slice of them there too (memory.py).

Keys are `<segment index>/<state>`: the segment order is the optimizer's, fixed by the layout,
which the snapshot's identity check (world size, layout) and restore's shape check pin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from engine.checkpointing.stateful import SavedCheckpoint

if TYPE_CHECKING:
    from engine.distributed.data_parallel import DataParallel
    from engine.optimizer.optimizer import TrainingOptimizer

MOMENTS = ("exp_avg", "exp_avg_sq")


class OptimizerShards:
    """Per optimizer segment: its fp32 master where that is a copy (an fp32 parameter's master
    is the parameter itself, restored with the model part) and Adam's two moments; `adam_step`
    in the meta."""

    def __init__(self, optimizer: TrainingOptimizer, ddp_chunks: list[DataParallel]) -> None:
        self.optimizer = optimizer
        self._groups = self._replica_groups(optimizer, ddp_chunks)
        self._loading: dict[str, torch.Tensor] | None = None

    @staticmethod
    def _replica_groups(optimizer: TrainingOptimizer, ddp_chunks: list[DataParallel]) -> list:
        """Per segment, the group whose ranks hold it alike: its bucket's, when that bucket's
        optimizer state is not sharded (each replica steps the whole parameter)."""
        owner = {id(p): ddp for ddp in ddp_chunks for p in ddp.module.parameters()}
        groups = []
        for p, _, _ in optimizer.segments:
            ddp = owner.get(id(p))
            bucket = ddp.bucket_of.get(id(p)) if ddp is not None else None
            shared = bucket is not None and not ddp.shard and bucket.world > 1 and bucket.group is not None
            groups.append(bucket.group if shared else None)
        return groups

    def _names(self, i: int) -> tuple[str, ...]:
        return ("master", *MOMENTS) if self.optimizer.needs_copy_back[i] else MOMENTS

    def state_dict(self) -> dict[str, Any]:
        opt = self.optimizer
        out: dict[str, Any] = {}
        for i, m in enumerate(opt.main_params):
            state = opt.inner.state.get(m) or {}
            for name in self._names(i):
                # Before the first step Adam has no moments: zeros are what it starts from.
                if name == "master":
                    out[f"{i}/{name}"] = m
                else:
                    out[f"{i}/{name}"] = state[name] if name in state else torch.zeros_like(m)
        steps = [int(s["step"]) for s in opt.inner.state.values() if "step" in s]
        out["adam_step"] = max(steps, default=0)
        return out

    def replica_group(self, key: str) -> dist.ProcessGroup | None:
        return self._groups[int(key.partition("/")[0])]

    def load_target(self, saved: SavedCheckpoint) -> dict[str, Any]:
        """The masters themselves, and fresh buffers for the moments (a trainer that has not
        stepped yet has none to load into)."""
        opt = self.optimizer
        target: dict[str, Any] = {"adam_step": None}
        self._loading = {}
        for i, m in enumerate(opt.main_params):
            for name in self._names(i):
                if name == "master":
                    target[f"{i}/master"] = m
                else:
                    target[f"{i}/{name}"] = self._loading[f"{i}/{name}"] = torch.empty_like(m)
        return target

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        loading, self._loading = self._loading, None
        source = loading if loading is not None else state_dict
        opt = self.optimizer
        for i, m in enumerate(opt.main_params):
            if opt.needs_copy_back[i] and state_dict[f"{i}/master"] is not m:
                m.copy_(state_dict[f"{i}/master"])
            moments = {name: source[f"{i}/{name}"] for name in MOMENTS}
            opt.inner.state[m] = {"step": torch.tensor(float(state_dict["adam_step"])), **moments}
