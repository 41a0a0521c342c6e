"""The sharded state of a rank, in global coordinates, and putting a loaded one back.

Every tensor is keyed by its name in the whole model (global layer numbers on every pipeline
stage; the last stage's tied output weight is `embedding.weight`, so it deduplicates with the
first stage's) and described by its global shape and this rank's place in it:
- a TP-sharded parameter becomes a DTensor sharded on a mesh over its TP group, so
  torch.distributed.checkpoint (DCP) records each piece's global offset and a different layout
  reads exactly the slices it needs;
- a parameter made of `partition_stride` independently split chunks (SwiGLU's gate|up) is
  stored as one key per chunk (`name#k`), because a single DTensor cannot express a strided
  split; the keys do not depend on the layout;
- replicated tensors (norms, DP replicas) are plain tensors; DCP writes one replica.

Optimizer state (fp32 master weights when they are copies, Adam's two moments) is stored with
the parameter's own shape and sharding, whatever the data-parallel size. Under the distributed
optimizer each DP rank owns arbitrary flat ranges of each parameter, which DCP cannot describe,
so those ranges are assembled to parameter shape over DP before saving (a sum of disjoint
pieces) and cut back to the new layout's ranges after loading. That costs one transient
parameter-sized copy per state during a save; writing the flat ranges directly is the next step
when checkpoint memory matters.

Non-tensor state goes into the manifest (see checkpointer.py), and RNG states are per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from engine import device
from engine import parallel_state as ps
from engine.tensor_parallel.random import get_rng_tracker

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master")


def _tp_mesh() -> DeviceMesh | None:
    if ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return DeviceMesh.from_group(ps.get_tensor_model_parallel_group(), device.current_device().type)


def _pieces(key: str, local: torch.Tensor, param: nn.Parameter, mesh: DeviceMesh | None) -> dict:
    """{key(#k): tensor or DTensor} for one parameter-shaped local tensor."""
    dim = getattr(param, "partition_dim", None)
    stride = getattr(param, "partition_stride", 1)
    chunks = local.chunk(stride, dim=dim) if dim is not None and stride > 1 else [local]
    out = {}
    for k, chunk in enumerate(chunks):
        name = f"{key}#{k}" if len(chunks) > 1 else key
        if dim is not None and mesh is not None:
            out[name] = DTensor.from_local(chunk.contiguous(), mesh, [Shard(dim)], run_check=False)
        else:
            out[name] = chunk
    return out


def named_params(trainer) -> list[tuple[str, nn.Parameter, object]]:
    """(global name, param, owning DataParallel chunk) for every parameter on this rank."""
    out = []
    for model, ddp in zip(trainer.model_chunks, trainer.ddp_chunks, strict=True):
        for name, p in model.named_parameters():
            out.append((model.global_param_name(name), p, ddp))
    return out


def _adam_state(opt, main: torch.Tensor, name: str) -> torch.Tensor:
    """Adam's moment for a master; zeros before the first step (Adam creates its state lazily),
    which is exactly what a fresh Adam starts from, so a checkpoint of iteration 0 loads right."""
    state = opt.inner.state.get(main)
    return state[name] if state and name in state else torch.zeros_like(main)


@torch.no_grad()
def optimizer_state_by_param(trainer) -> dict[int, dict[str, torch.Tensor]]:
    """id(param) -> {state name: parameter-shaped fp32 tensor}, assembled over DP for ZeRO-1."""
    opt = trainer.optimizer
    segments = {id(p): [] for _, p, _ in named_params(trainer)}
    for i, (p, lo, hi) in enumerate(opt.segments):
        segments[id(p)].append((i, lo, hi))
    out = {}
    for _, p, ddp in named_params(trainer):
        # The shards span the chunk's data-parallel group: DP, or DP x CP under context parallelism.
        sharded = ddp.shard and ddp.dp > 1
        states = {}
        for name in STATE_NAMES:
            if name == "master" and not any(opt.needs_copy_back):
                continue
            segs = segments[id(p)]
            if not sharded and len(segs) == 1 and segs[0][1:] == (0, p.numel()):
                i = segs[0][0]  # this rank holds the whole state: a view, no copy
                m = opt.main_params[i]
                states[name] = (m if name == "master" else _adam_state(opt, m, name)).view(p.shape)
                continue
            flat = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)  # all-reduced: NCCL on GPU
            for i, lo, hi in segs:
                m = opt.main_params[i]
                flat[lo:hi] = m if name == "master" else _adam_state(opt, m, name)
            if sharded:
                dist.all_reduce(flat, group=ddp.group)
            states[name] = flat.view(p.shape)
        out[id(p)] = states
    return out


def named_buffers(trainer) -> list[tuple[str, torch.Tensor]]:
    """(global name, buffer) of the model state that is not a parameter but must survive a
    restart: MoE routers' expert bias (aux-loss-free balancing). Replicated on every rank that
    holds the layer, so DCP writes it once."""
    out = []
    for model in trainer.model_chunks:
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                out.append((model.global_param_name(name), buf))
    return out


def rng_key() -> str:
    g = ps.get_grid()
    c = g.coords(dist.get_rank())
    return f"rng/pp{c['pp']}-tp{c['tp']}-cp{c['cp']}-dp{c['dp']}"


def _rng_state() -> dict[str, torch.Tensor]:
    states = {"default": device.get_rng_state()}
    states.update({f"tracker.{k}": v for k, v in get_rng_tracker().get_states().items()})
    return states


def build_state_dict(trainer) -> dict[str, object]:
    """Everything tensor-valued a checkpoint holds for this rank, DCP-ready."""
    mesh = _tp_mesh()
    state: dict[str, object] = {}
    opt_states = optimizer_state_by_param(trainer)
    for gname, p, _ in named_params(trainer):
        state.update(_pieces(f"model/{gname}", p.detach(), p, mesh))
        for name, tensor in opt_states[id(p)].items():
            state.update(_pieces(f"optim/{gname}/{name}", tensor, p, mesh))
    for gname, buf in named_buffers(trainer):
        state[f"model/{gname}"] = buf
    for name, tensor in _rng_state().items():
        state[f"{rng_key()}/{name}"] = tensor
    return state


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


def empty_state_dict(
    trainer, with_master: bool, with_rng: bool
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """The same keys with this layout's shapes for DCP to load into, and the parameter-shaped
    local tensors behind them. Model weights load straight into the parameters; optimizer
    state into fresh buffers; strided pieces are views of one buffer, so nothing is
    concatenated or copied after the load."""
    mesh = _tp_mesh()
    state: dict[str, object] = {}
    buffers: dict[str, torch.Tensor] = {}
    for gname, p, _ in named_params(trainer):
        mine = {f"model/{gname}": p.detach()}
        for name in STATE_NAMES:
            if name != "master" or with_master:
                # On the param's device: the optimizer keeps these as its state.
                mine[f"optim/{gname}/{name}"] = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        for key, local in mine.items():
            state.update(_pieces(key, local, p, mesh))
        buffers.update(mine)
    for gname, buf in named_buffers(trainer):
        state[f"model/{gname}"] = buf  # loads in place
    if with_rng:
        for name, tensor in _rng_state().items():
            state[f"{rng_key()}/{name}"] = torch.empty_like(tensor)
    return state, buffers


@torch.no_grad()
def apply_state_dict(
    trainer,
    state: dict[str, object],
    buffers: dict[str, torch.Tensor],
    adam_step: int,
    with_master: bool,
    with_rng: bool,
) -> None:
    """Put a loaded state into the optimizer (this layout's ranges) and the RNGs; the weights
    are already in the parameters."""
    opt = trainer.optimizer
    full = {
        id(p): {n: buffers[f"optim/{gname}/{n}"] for n in STATE_NAMES if f"optim/{gname}/{n}" in buffers}
        for gname, p, _ in named_params(trainer)
    }
    for i, (p, lo, hi) in enumerate(opt.segments):
        m = opt.main_params[i]
        states = full[id(p)]
        if opt.needs_copy_back[i]:
            source = states["master"] if with_master else p.detach().float()
            m.copy_(source.reshape(-1)[lo:hi])
        # A whole parameter keeps the loaded tensor; a slice is copied, or its view would pin
        # the whole parameter-sized tensor in memory.
        whole = (lo, hi) == (0, p.numel())
        moments = {
            name: states[name].reshape(-1) if whole else states[name].reshape(-1)[lo:hi].clone()
            for name in ("exp_avg", "exp_avg_sq")
        }
        opt.inner.state[m] = {"step": torch.tensor(float(adam_step)), **moments}
    for ddp in trainer.ddp_chunks:
        ddp.gather_params()
    if with_rng:
        prefix = rng_key()
        device.set_rng_state(state[f"{prefix}/default"])
        tracker = {
            k.removeprefix(f"{prefix}/tracker."): v
            for k, v in state.items()
            if k.startswith(f"{prefix}/tracker.")
        }
        get_rng_tracker().set_states(tracker)
