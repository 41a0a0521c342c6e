"""The tensor parts of a rank's checkpoint (model weights, optimizer state, RNG streams), in
global coordinates, and putting loaded ones back.

Each part is a `Stateful` (stateful.py) whose keys the checkpointer prefixes with the part's
name ("model/", "optim/", "rng/"). Every tensor is keyed by its name in the whole model (global
layer numbers on every pipeline stage; the last stage's tied output weight is `embedding.weight`,
so it deduplicates with the first stage's) and described by its global shape and this rank's
place in it:
- a TP-sharded parameter becomes a DTensor sharded on a mesh over its TP group, so
  torch.distributed.checkpoint (DCP) records each piece's global offset and a different layout
  reads exactly the slices it needs;
- a parameter made of `tp_stride` independently split chunks (SwiGLU's gate|up) is
  stored as one key per chunk (`name#k`), because a single DTensor cannot express a strided
  split; the keys do not depend on the layout;
- replicated tensors (norms, DP replicas, MoE routers' expert bias) are plain tensors; DCP
  writes one replica.

Optimizer state (fp32 master weights when they are copies, Adam's two moments) is stored with
the parameter's own shape and sharding, whatever the data-parallel size. Each rank writes and
reads only its own flat ranges of each parameter (its optimizer segments; under
optim_grads_params its persistent parameter shards too) as DCP boxes of the global tensor
(flat_ranges.py): no parameter-shaped assembly, no whole-model gather, no collective beyond
DCP's own planning, and the save and load hold nothing the rank does not hold anyway. Another
layout reads the boxes it needs from the same global tensors.

RNG states are per rank, keyed by the rank's place in the grid, and restored only on the
layout that saved them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from engine import device
from engine import parallel_state as ps
from engine.checkpointing.flat_ranges import FlatRanges, flat_range_entries
from engine.checkpointing.stateful import SavedCheckpoint
from engine.parallel_placement import placement_of
from engine.tensor_parallel.random import load_rng_state_dict, model_parallel_manual_seed, rng_state_dict

if TYPE_CHECKING:
    from engine.distributed.data_parallel import DataParallel
    from engine.optimizer.optimizer import TrainingOptimizer

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master")


def _tp_mesh() -> DeviceMesh | None:
    if ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return DeviceMesh.from_group(ps.get_tensor_model_parallel_group(), device.current_device().type)


def _pieces(key: str, local: torch.Tensor, param: nn.Parameter, mesh: DeviceMesh | None) -> dict:
    """{key(#k): tensor or DTensor} for one parameter-shaped local tensor."""
    placement = placement_of(param)
    dim, stride = placement.tp_dim, placement.tp_stride
    chunks = local.chunk(stride, dim=dim) if dim is not None and stride > 1 else [local]
    out = {}
    for k, chunk in enumerate(chunks):
        name = f"{key}#{k}" if len(chunks) > 1 else key
        if dim is not None and mesh is not None:
            out[name] = DTensor.from_local(chunk.contiguous(), mesh, [Shard(dim)], run_check=False)
        else:
            out[name] = chunk
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _flat_pieces(key: str, param: nn.Parameter, ranges: list[tuple[int, int, torch.Tensor]]) -> dict:
    """{key(#k): FlatRanges} for this rank's flat ranges (lo, hi, flat tensor) of `param`'s
    local (TP) piece, in the global tensor's coordinates."""
    tp_world = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank() if tp_world > 1 else 0
    dtype = ranges[0][2].dtype if ranges else torch.float32
    return flat_range_entries(key, placement_of(param), param.shape, dtype, ranges, tp_rank, tp_world)


def named_params(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(global name, param) for every trained parameter of this rank's model chunks (a frozen
    one, a LoRA job's base, comes back from where it started: model.init_from or the seed)."""
    return [
        (model.global_param_name(name), p)
        for model in chunks
        for name, p in model.named_parameters()
        if p.requires_grad
    ]


def named_buffers(chunks: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """(global name, buffer) of the model state that is not a parameter but must survive a
    restart: MoE routers' expert bias (aux-loss-free balancing). Replicated on every rank that
    holds the layer, so DCP writes it once."""
    out = []
    for model in chunks:
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                out.append((model.global_param_name(name), buf))
    return out


class ModelState:
    """This rank's model chunks: every parameter and the buffers that must survive a restart.

    Its state dict is views of what the rank holds, so a save copies nothing (an async save
    snapshots it) and a load lands in place: the parameters themselves, or, when data
    parallelism keeps them as shards (optim_grads_params), this rank's flat ranges of each in
    its buckets' persistent shards (FlatRanges: no gather, nothing parameter-sized). The
    checkpoint holds the same global tensors at every sharding level."""

    def __init__(self, chunks: list[nn.Module], ddp_chunks: list[DataParallel] | None = None) -> None:
        self.chunks = chunks
        self.ddp_chunks = ddp_chunks or []

    def _in_shards(self) -> dict[int, list[tuple[int, int, torch.Tensor]]]:
        """id(param) -> its (lo, hi, shard view) ranges on this rank, for sharded parameters."""
        out: dict[int, list] = {}
        for ddp in self.ddp_chunks:
            for p, lo, hi, view in ddp.checkpoint_view().shard_segments:
                out.setdefault(id(p), []).append((lo, hi, view))
        return out

    def state_dict(self) -> dict[str, Any]:
        in_shards = self._in_shards()
        sharded = {id(p) for ddp in self.ddp_chunks for p in ddp.checkpoint_view().sharded_params}
        mesh = _tp_mesh()
        out: dict[str, Any] = {}
        for gname, p in named_params(self.chunks):
            if id(p) in sharded:
                out.update(_flat_pieces(gname, p, in_shards.get(id(p), [])))
            else:
                out.update(_pieces(gname, p.detach(), p, mesh))
        for gname, buf in named_buffers(self.chunks):
            out[gname] = buf
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # What was loaded into state_dict()'s views is in place already; other tensors are copied in.
        for key, mine in self.state_dict().items():
            src = state_dict[key]
            if isinstance(mine, FlatRanges):
                if src is not mine:
                    mine.copy_from(src)
                continue
            dst, src = _local(mine), _local(src)
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        for ddp in self.ddp_chunks:
            if ddp.checkpoint_view().params_sharded:
                ddp.checkpoint_view().refresh()  # gathered copies are stale: the next use regathers


class OptimizerState:
    """AdamW's state for this rank's parameters: per parameter and state, this rank's flat
    segments as FlatRanges of the parameter-shaped global tensor; `adam_step` and `has_master`
    (whether the masters are copies, so saved) in the meta."""

    def __init__(
        self, optimizer: TrainingOptimizer, chunks: list[nn.Module], ddp_chunks: list[DataParallel]
    ) -> None:
        self.optimizer, self.chunks, self.ddp_chunks = optimizer, chunks, ddp_chunks
        self._loading: dict[tuple[int, str], torch.Tensor] | None = None  # load_target's tensors

    def _named(self) -> list[tuple[str, nn.Parameter]]:
        """(global name, param) for every parameter data parallelism holds on this rank (this
        rank may own no segment of a small one: its entry then has no pieces)."""
        return [
            (gname, p)
            for model, ddp in zip(self.chunks, self.ddp_chunks, strict=True)
            for gname, p in named_params([model])
            if ddp.checkpoint_view().holding(p) is not None
        ]

    def _with_master(self) -> bool:
        return self.optimizer.has_master_copies()

    def _entries(self, tensor_of, names) -> dict[str, Any]:
        """{"<param>/<state>(#k)": FlatRanges} over `tensor_of(i, name)` for each segment i."""
        by_param: dict[int, list[int]] = {}
        for i, (p, _, _) in enumerate(self.optimizer.segments):
            by_param.setdefault(id(p), []).append(i)
        out: dict[str, Any] = {}
        for gname, p in self._named():
            segs = by_param.get(id(p), [])
            for name in names:
                ranges = [(*self.optimizer.segments[i][1:], tensor_of(i, name)) for i in segs]
                out.update(_flat_pieces(f"{gname}/{name}", p, ranges))
        return out

    def _names(self, with_master: bool) -> tuple[str, ...]:
        return tuple(n for n in STATE_NAMES if n != "master" or with_master)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's own tensors, as this rank's flat ranges: nothing copied or assembled."""
        opt = self.optimizer
        out = self._entries(opt.segment_state, self._names(self._with_master()))
        out["adam_step"] = opt.adam_step()
        out["has_master"] = self._with_master()
        return out

    def load_target(self, saved: SavedCheckpoint) -> dict[str, Any]:
        """The state tensors themselves, loaded in place: Adam's moments where it has them (a
        trainer that has not stepped yet gets fresh segment-sized ones), the masters (only when
        both the checkpoint and this job have them: otherwise they come from the loaded weights)."""
        with_master = bool(saved.meta["has_master"]) and self._with_master()
        opt = self.optimizer
        loading: dict[tuple[int, str], torch.Tensor] = {}

        def tensor_of(i: int, name: str) -> torch.Tensor:
            loading[(i, name)] = opt.segment_state(i, name)
            return loading[(i, name)]

        target = self._entries(tensor_of, self._names(with_master))
        self._loading = loading
        target["adam_step"] = None
        target["has_master"] = None
        return target

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hand the loaded segments to the optimizer; the weights (model part) are already in
        place, and masters that were not saved are taken from them."""
        loading, self._loading = self._loading, None
        opt = self.optimizer
        if loading is None:  # not planned by load_target (a state_dict() of ours): copy it in
            loading = {}

            def tensor_of(i: int, name: str) -> torch.Tensor:
                loading[(i, name)] = opt.segment_state(i, name)
                return loading[(i, name)]

            with_master = bool(state_dict.get("has_master")) and self._with_master()
            for key, mine in self._entries(tensor_of, self._names(with_master)).items():
                mine.copy_from(state_dict[key])
        step = state_dict["adam_step"]
        for i in range(len(opt.segments)):
            loaded = {name: loading[(i, name)] for name in opt.state_names(i) if name != "master"}
            if "master" in opt.state_names(i):  # a copy: loaded in place, or else from the weights
                loaded["master"] = loading.get((i, "master"), opt.segment_param(i).float())
            opt.load_segment_state(i, step, loaded)
        for ddp in self.ddp_chunks:
            ddp.checkpoint_view().refresh()


def _grid_position() -> str:
    c = ps.get_grid().coords(dist.get_rank())
    return f"pp{c['pp']}-tp{c['tp']}-cp{c['cp']}-dp{c['dp']}"


class RNGState:
    """This rank's random streams: the device default and the TP tracker's, keyed by the rank's
    place in the grid. They mean something only on the layout that saved them; on any other one
    nothing is loaded and every rank reseeds from (seed, iteration), deterministically."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._reseed_at: int | None = None

    def state_dict(self) -> dict[str, Any]:
        pos = _grid_position()
        return {f"{pos}/{key}": value for key, value in rng_state_dict().items()}

    def load_target(self, saved: SavedCheckpoint) -> dict[str, Any]:
        if not saved.same_layout:
            self._reseed_at = saved.iteration
            return {}
        self._reseed_at = None
        return {key: torch.empty_like(t) for key, t in self.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        reseed_at, self._reseed_at = self._reseed_at, None
        if reseed_at is not None:
            model_parallel_manual_seed(self.seed + reseed_at)
            return
        prefix = f"{_grid_position()}/"
        load_rng_state_dict({k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)})


def snapshot(state: dict[str, object], buffers: dict[str, torch.Tensor]) -> dict[str, object]:
    """A copy in host memory that training can no longer change (for a background save).

    `buffers` keeps the host tensors between saves: copying into memory already touched is
    several times faster than into fresh pages, and a save only starts after the previous one
    finished with them."""
    out: dict[str, object] = {}
    copied: dict[tuple[int, int, int], torch.Tensor] = {}  # flat sources shared by strided keys
    for key, value in state.items():
        if isinstance(value, FlatRanges):
            sources = []
            for j, (lo, hi, flat) in enumerate(value.sources):
                ident = (flat.untyped_storage().data_ptr(), flat.storage_offset(), flat.numel())
                if ident not in copied:
                    host = buffers.get(f"{key}@{j}")
                    if host is None or host.shape != flat.shape or host.dtype != flat.dtype:
                        host = buffers[f"{key}@{j}"] = torch.empty(flat.shape, dtype=flat.dtype, device="cpu")
                    copied[ident] = host.copy_(flat.detach())
                sources.append((lo, hi, copied[ident]))
            out[key] = value.with_sources(sources)
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        host = buffers.get(key)
        if host is None or host.shape != local.shape or host.dtype != local.dtype:
            host = buffers[key] = torch.empty(local.shape, dtype=local.dtype, device="cpu")
        host.copy_(local.detach())
        if isinstance(value, DTensor):
            out[key] = DTensor.from_local(host, value.device_mesh, value.placements, run_check=False)
        else:
            out[key] = host
    return out
