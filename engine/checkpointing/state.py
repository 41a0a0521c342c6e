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
the parameter's own shape and sharding, whatever the data-parallel size. Under the distributed
optimizer each DP rank owns arbitrary flat ranges of each parameter, which DCP cannot describe,
so those ranges are assembled to parameter shape over the chunk's DP group before saving (a sum
of disjoint pieces) and cut back to the new layout's ranges after loading. That costs one
transient parameter-sized copy per state during a save; writing the flat ranges directly is the
next step when checkpoint memory matters. Loading does not assemble anything: the optimizer
part loads into fresh parameter-shaped buffers (`load_target`).

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

    Its state dict is views of the parameters themselves, so a save copies nothing (an async
    save snapshots it) and a load lands straight in the parameters. When data parallelism keeps
    parameters as shards (optim_grads_params), `ddp_chunks` gathers them whole first (a
    collective; the next training step frees them again) and the state dict holds copies (one
    transient model-sized copy per rank during a save, as for the optimizer state); a load
    copies this rank's slices back into the shards: the checkpoint holds the same global
    tensors at every sharding level."""

    def __init__(self, chunks: list[nn.Module], ddp_chunks: list[DataParallel] | None = None) -> None:
        self.chunks = chunks
        self.ddp_chunks = ddp_chunks or []

    def state_dict(self) -> dict[str, Any]:
        return self._tensors(copies=any(ddp.checkpoint_view().params_sharded for ddp in self.ddp_chunks))

    def _tensors(self, copies: bool) -> dict[str, Any]:
        """Views of the parameters, or copies of them: the storage of gathered sharded parameters
        is freed by resizing it, which storage handed to the checkpoint's I/O (numpy views) forbids."""
        for ddp in self.ddp_chunks:
            ddp.checkpoint_view().gather_whole()
        mesh = _tp_mesh()
        out: dict[str, Any] = {}
        for gname, p in named_params(self.chunks):
            out.update(_pieces(gname, p.detach().clone() if copies else p.detach(), p, mesh))
        for gname, buf in named_buffers(self.chunks):
            out[gname] = buf
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # What was loaded into state_dict()'s views is in place already; other tensors are copied in.
        for key, mine in self._tensors(copies=False).items():
            dst, src = _local(mine), _local(state_dict[key])
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        for ddp in self.ddp_chunks:
            ddp.checkpoint_view().scatter_loaded()


class OptimizerState:
    """AdamW's state for this rank's parameters, parameter-shaped, with `adam_step` and
    `has_master` (whether the masters are copies, so saved) in the meta."""

    def __init__(
        self, optimizer: TrainingOptimizer, chunks: list[nn.Module], ddp_chunks: list[DataParallel]
    ) -> None:
        self.optimizer, self.chunks, self.ddp_chunks = optimizer, chunks, ddp_chunks
        self._loading: dict[str, torch.Tensor] | None = None  # load_target's buffers

    def _named(self) -> list[tuple[str, nn.Parameter, DataParallel]]:
        """(global name, param, owning DataParallel chunk) for every parameter on this rank."""
        return [
            (gname, p, ddp)
            for model, ddp in zip(self.chunks, self.ddp_chunks, strict=True)
            for gname, p in named_params([model])
        ]

    def _with_master(self) -> bool:
        return self.optimizer.has_master_copies()

    @torch.no_grad()
    def _by_param(self) -> dict[int, dict[str, torch.Tensor]]:
        """id(param) -> {state name: parameter-shaped fp32 tensor}, assembled over DP for ZeRO-1."""
        opt = self.optimizer
        named = self._named()
        segments = {id(p): [] for _, p, _ in named}
        for i, (p, lo, hi) in enumerate(opt.segments):
            segments[id(p)].append((i, lo, hi))
        with_master = self._with_master()
        out = {}
        for _, p, ddp in named:
            # The shards span the param's bucket group: DP (DP x CP under context parallelism, one
            # shard group under HSDP), or the expert data-parallel group for MoE experts.
            group = ddp.checkpoint_view().holding(p).state_group
            sharded = group is not None
            states = {}
            for name in STATE_NAMES:
                if name == "master" and not with_master:
                    continue
                segs = segments[id(p)]
                if not sharded and len(segs) == 1 and segs[0][1:] == (0, p.numel()):
                    i = segs[0][0]  # this rank holds the whole state: a view, no copy
                    states[name] = opt.segment_state(i, name).view(p.shape)
                    continue
                # On the param's device: all-reduced, so NCCL on GPU.
                flat = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                for i, lo, hi in segs:
                    flat[lo:hi] = opt.segment_state(i, name)
                if sharded:  # over one shard group: HSDP replicas hold the same pieces
                    dist.all_reduce(flat, group=group)
                states[name] = flat.view(p.shape)
            out[id(p)] = states
        return out

    def state_dict(self) -> dict[str, Any]:
        """A collective under the distributed optimizer (the assembly over DP)."""
        mesh = _tp_mesh()
        out: dict[str, Any] = {}
        states = self._by_param()
        for gname, p, _ in self._named():
            for name, tensor in states[id(p)].items():
                out.update(_pieces(f"{gname}/{name}", tensor, p, mesh))
        out["adam_step"] = self.optimizer.adam_step()
        out["has_master"] = self._with_master()
        return out

    def load_target(self, saved: SavedCheckpoint) -> dict[str, Any]:
        """Fresh parameter-shaped buffers in this layout's sharding (masters only when both the
        checkpoint and this job have them: otherwise they come from the loaded weights); strided
        pieces are views of one buffer, so nothing is concatenated after the load."""
        with_master = bool(saved.meta["has_master"]) and self._with_master()
        mesh = _tp_mesh()
        target: dict[str, Any] = {}
        buffers: dict[str, torch.Tensor] = {}
        for gname, p, _ in self._named():
            for name in STATE_NAMES:
                if name != "master" or with_master:
                    key = f"{gname}/{name}"
                    # On the param's device: the optimizer keeps these as its state.
                    buffers[key] = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                    target.update(_pieces(key, buffers[key], p, mesh))
        self._loading = buffers
        target["adam_step"] = None
        target["has_master"] = None
        return target

    def _whole(self, state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Parameter-shaped local tensors from a state dict that did not come from load_target."""
        out = {}
        for gname, p, _ in self._named():
            for name in STATE_NAMES:
                key = f"{gname}/{name}"
                if key in state_dict:
                    out[key] = _local(state_dict[key])
                elif f"{key}#0" in state_dict:
                    placement = placement_of(p)
                    pieces = [_local(state_dict[f"{key}#{k}"]) for k in range(placement.tp_stride)]
                    out[key] = torch.cat(pieces, dim=placement.tp_dim)
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Cut the loaded state to this layout's ranges; the weights (model part) are already in
        the parameters, and masters that were not saved are taken from them."""
        buffers, self._loading = self._loading, None
        if buffers is None:
            buffers = self._whole(state_dict)
        opt = self.optimizer
        step = state_dict["adam_step"]
        full = {
            id(p): {n: buffers[f"{gname}/{n}"] for n in STATE_NAMES if f"{gname}/{n}" in buffers}
            for gname, p, _ in self._named()
        }
        for i, (p, lo, hi) in enumerate(opt.segments):
            states = full[id(p)]
            # A whole parameter keeps the loaded tensor; a slice is copied, or its view would pin
            # the whole parameter-sized tensor in memory.
            whole = (lo, hi) == (0, p.numel())
            loaded = {
                name: states[name].reshape(-1) if whole else states[name].reshape(-1)[lo:hi].clone()
                for name in opt.state_names(i)
                if name != "master"
            }
            if "master" in opt.state_names(i):  # a copy: loaded, or else taken from the weights
                source = states["master"] if "master" in states else p.detach().float()
                loaded["master"] = source.reshape(-1)[lo:hi]
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
    for key, value in state.items():
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
