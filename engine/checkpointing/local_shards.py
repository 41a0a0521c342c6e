"""This rank's model and optimizer state as it holds it, for in-memory snapshots of the same layout.

The persistent checkpoint stores every tensor in global, parameter-shaped form so that another
layout can load it (state.py; each rank writes its own flat ranges as boxes of those tensors,
flat_ranges.py). An in-memory snapshot is taken as often as every step and is only ever
restored by the same rank of the same layout, so it keeps what the rank holds, keyed by the
rank's own structure: no DCP planning, no collective, nothing the rank does not already have.

- `ModelShards`: whole parameters where the rank holds them whole (the same on every data-parallel
  replica: `replica_group` says so, and a snapshot keeps a 1/n slice of them, memory.py); under
  ZeRO-3 each bucket's persistent shard instead (the same on the HSDP replicas of that shard);
  the buffers that must survive a restart (MoE expert bias).
- `OptimizerShards`: the optimizer's own flat segments: fp32 masters where they are copies, and
  Adam's moments (whole parameters and replicated without the distributed optimizer; the same on
  the HSDP replicas of a shard with it).

Keys name the rank's own structure (`<chunk>/<parameter>`, `<chunk>/bucket<b>`,
`<segment>/<state>`): fixed by the layout, which the snapshot's identity check (world size,
layout) and restore's shape check pin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from engine.checkpointing.stateful import SavedCheckpoint

if TYPE_CHECKING:
    from engine.distributed.data_parallel import DataParallel
    from engine.optimizer.optimizer import TrainingOptimizer


class ModelShards:
    """See the module docstring. Entries are listed once: the modules and buckets do not change."""

    def __init__(self, chunks: list[nn.Module], ddp_chunks: list[DataParallel]) -> None:
        self.ddp_chunks = ddp_chunks
        # key -> (parameter, buffer or shard; the group whose ranks hold it alike, or None)
        self.entries: dict[str, tuple[torch.Tensor, dist.ProcessGroup | None]] = {}
        for j, (model, ddp) in enumerate(zip(chunks, ddp_chunks, strict=True)):
            view = ddp.checkpoint_view()
            for b, shard in enumerate(view.shards):
                self.entries[f"{j}/bucket{b}"] = (shard.tensor, shard.replicas)
            for name, p in model.named_parameters():
                holding = view.holding(p)
                if holding is not None and holding.in_shard:
                    continue  # in its bucket's shard
                self.entries[f"{j}/{name}"] = (p, holding.value_replicas if holding is not None else None)
            for name, buf in model.named_buffers():
                if name.endswith("expert_bias"):
                    self.entries[f"{j}/{name}"] = (buf, None)

    def state_dict(self) -> dict[str, Any]:
        return {key: t.detach() for key, (t, _) in self.entries.items()}

    def replica_group(self, key: str) -> dist.ProcessGroup | None:
        return self.entries[key][1]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The values were loaded in place (state_dict() is views); gathered copies of sharded
        # parameters are stale now, and the next use gathers the restored shards.
        for ddp in self.ddp_chunks:
            if ddp.checkpoint_view().params_sharded:
                ddp.checkpoint_view().refresh()


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
        """Per segment, the group whose ranks hold it alike: without the distributed optimizer
        its bucket's (each replica steps the whole parameter); with it, the HSDP replicas of its
        shard (None without HSDP: the shard is this rank's alone)."""
        views = [ddp.checkpoint_view() for ddp in ddp_chunks]
        groups = []
        for p, _, _ in optimizer.segments:
            holding = next((h for v in views if (h := v.holding(p)) is not None), None)
            groups.append(holding.state_replicas if holding is not None else None)
        return groups

    def state_dict(self) -> dict[str, Any]:
        opt = self.optimizer
        out: dict[str, Any] = {}
        for i in range(len(opt.segments)):
            for name in opt.state_names(i):
                out[f"{i}/{name}"] = opt.segment_state(i, name)
        out["adam_step"] = opt.adam_step()
        return out

    def replica_group(self, key: str) -> dist.ProcessGroup | None:
        return self._groups[int(key.partition("/")[0])]

    def load_target(self, saved: SavedCheckpoint) -> dict[str, Any]:
        """The masters themselves, and fresh buffers for the moments (a trainer that has not
        stepped yet has none to load into)."""
        opt = self.optimizer
        target: dict[str, Any] = {"adam_step": None}
        self._loading = {}
        for i in range(len(opt.segments)):
            master = opt.segment_state(i, "master")
            for name in opt.state_names(i):
                if name == "master":
                    target[f"{i}/master"] = master
                else:
                    target[f"{i}/{name}"] = self._loading[f"{i}/{name}"] = torch.empty_like(master)
        return target

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        loading, self._loading = self._loading, None
        source = loading if loading is not None else state_dict
        opt = self.optimizer
        for i in range(len(opt.segments)):
            # The master as loaded (in place when it is the master itself), the moments as loaded
            # into load_target's buffers (or as given, without a load_target).
            loaded = {name: source[f"{i}/{name}"] for name in opt.state_names(i) if name != "master"}
            if "master" in opt.state_names(i):
                loaded["master"] = state_dict[f"{i}/master"]
            opt.load_segment_state(i, state_dict["adam_step"], loaded)
