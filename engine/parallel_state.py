"""The rank grid: which ranks form each tensor/context/expert/data/pipeline parallel group.

Two layers:
- `RankGrid` is pure arithmetic over rank numbers (no processes, no torch.distributed), so
  every layout can be checked in a unit test and an impossible one is refused with a clear
  message before any group is made.
- `initialize_model_parallel` builds torch process groups from a grid and keeps them in one
  module-level state that the parallel layers read through the getters below.

Order follows Megatron-Core's default `tp-cp-ep-dp-pp`: TP innermost (neighbouring ranks, the
fastest links), PP outermost. As in Megatron-Core the dense grid does not split on `ep` (it is
folded into data parallel); experts get their own grid etp-ep-edp-pp that shares the pipeline
groups with the dense grid, so attention and experts can be laid out differently ("parallel
folding").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist

DEFAULT_ORDER = ("tp", "cp", "ep", "dp", "pp")


class LayoutError(ValueError):
    """A parallel layout that cannot be built on the given number of ranks."""


def _groups_along(sizes: dict[str, int], dims: tuple[str, ...]) -> list[list[int]]:
    """Rank lists that vary along `dims` and agree on every other dimension.

    `sizes` is ordered innermost first: rank = c0 + s0*(c1 + s1*(c2 + ...)).
    """
    unknown = set(dims) - set(sizes)
    if unknown:
        raise KeyError(f"unknown parallel dimension(s) {sorted(unknown)}; known: {list(sizes)}")
    world = math.prod(sizes.values())
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world):
        rest, key = rank, []
        for name, size in sizes.items():
            coord, rest = rest % size, rest // size
            if name not in dims:
                key.append(coord)
        groups.setdefault(tuple(key), []).append(rank)
    return sorted(groups.values(), key=lambda g: g[0])


@dataclass(frozen=True)
class RankGrid:
    """Pure rank arithmetic for a layout on `world_size` ranks."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; default: same as tp
    vpp: int | None = None
    order: tuple[str, ...] = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("etp", "vpp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LayoutError(f"{name} must be >= 1 (or unset), got {value}")
        if sorted(self.order) != sorted(DEFAULT_ORDER):
            raise LayoutError(
                f"order must be a permutation of {'-'.join(DEFAULT_ORDER)}, got {'-'.join(self.order)}"
            )
        mp = self.tp * self.pp * self.cp
        if self.world_size % mp:
            raise LayoutError(
                f"tensor ({self.tp}) x pipeline ({self.pp}) x context ({self.cp}) = {mp} does not divide "
                f"the {self.world_size} ranks"
            )
        # Experts fold onto the ranks of one pipeline stage however attention is laid out there
        # (Megatron-Core's rule): only expert-TP x EP x PP has to divide the world.
        etp = self.expert_tp
        if self.world_size % (etp * self.ep * self.pp):
            raise LayoutError(
                f"expert tensor ({etp}) x expert ({self.ep}) x pipeline ({self.pp}) does not divide "
                f"the {self.world_size} ranks"
            )
        if self.vpp is not None and self.pp == 1:
            raise LayoutError("virtual pipeline needs pipeline > 1")
        if self.groups("pp") != self.expert_groups("pp"):
            raise LayoutError(
                f"order {'-'.join(self.order)} puts experts of one group on different pipeline stages "
                "(the expert grid's pipeline groups differ from the dense grid's): keep pp outermost"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    def _dense_sizes(self) -> dict[str, int]:
        size = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        return {name: size[name] for name in self.order if name != "ep"}

    def _expert_sizes(self) -> dict[str, int]:
        size = {"tp": self.expert_tp, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}
        return {name: size[name] for name in self.order if name != "cp"}

    def groups(self, *dims: str) -> list[list[int]]:
        """Dense-grid groups along the named dims, e.g. groups("tp"), groups("dp", "cp")."""
        return _groups_along(self._dense_sizes(), dims)

    def expert_groups(self, *dims: str) -> list[list[int]]:
        """Expert-grid groups: dims among tp (expert TP), ep, dp (expert DP), pp."""
        return _groups_along(self._expert_sizes(), dims)

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline group (tied embedding gradients)."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's position along each dense dimension."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside [0, {self.world_size})")
        out, rest = {}, rank
        for name, size in self._dense_sizes().items():
            out[name], rest = rest % size, rest // size
        return out


@dataclass
class _State:
    grid: RankGrid
    rank: int
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    vpp_rank: int | None = None


_STATE: _State | None = None

# name -> (grid method, dims). Every rank creates every group in this fixed order.
_GROUP_SPECS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("groups", ("tp",)),
    "cp": ("groups", ("cp",)),
    "dp": ("groups", ("dp",)),
    "dp_cp": ("groups", ("dp", "cp")),
    "pp": ("groups", ("pp",)),
    "tp_cp": ("groups", ("tp", "cp")),
    "mp": ("groups", ("tp", "pp")),
    "tp_cp_dp": ("groups", ("tp", "cp", "dp")),  # every rank of one pipeline stage
    "ep": ("expert_groups", ("ep",)),
    "etp": ("expert_groups", ("tp",)),
    "edp": ("expert_groups", ("dp",)),
    "etp_ep": ("expert_groups", ("tp", "ep")),
    "emp": ("expert_groups", ("tp", "ep", "pp")),  # every expert once: the expert grad norm's group
}


def initialize_model_parallel(
    tensor: int = 1,
    pipeline: int = 1,
    context: int = 1,
    expert: int = 1,
    virtual_pipeline: int | None = None,
    expert_tensor: int | None = None,
    order: str = "tp-cp-ep-dp-pp",
    data_parallel_shard: int | None = None,
) -> RankGrid:
    """Create every process group of the layout on an initialised default group.

    `data_parallel_shard` (hybrid sharding, HSDP): also split every DP group into shard groups
    of that many consecutive DP ranks ("dp_shard") and the groups of ranks with the same place
    in their shard group ("dp_replica"). Under context parallelism gradients are reduced over DP
    x CP, so a shard group also holds its DP ranks' CP peers (N x cp ranks) and a replica group
    the ranks with the same place and the same CP rank."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: start ranks through engine.launcher or Ray Train"
        )
    grid = RankGrid(
        world_size=dist.get_world_size(),
        tp=tensor,
        pp=pipeline,
        cp=context,
        ep=expert,
        etp=expert_tensor,
        vpp=virtual_pipeline,
        order=tuple(order.split("-")),
    )
    rank = dist.get_rank()
    state = _State(grid=grid, rank=rank, vpp_rank=0 if virtual_pipeline else None)
    for name, (method, dims) in _GROUP_SPECS.items():
        for ranks in getattr(grid, method)(*dims):
            group = dist.new_group(ranks) if len(ranks) < grid.world_size else dist.group.WORLD
            if rank in ranks:
                state.groups[name], state.ranks[name] = group, ranks
    for ranks in grid.embedding_groups():
        group = dist.new_group(ranks)
        if rank in ranks:
            state.groups["embd"], state.ranks["embd"] = group, ranks
    if data_parallel_shard is not None and data_parallel_shard < grid.dp:
        for name, members in _hybrid_groups(grid, data_parallel_shard).items():
            for ranks in members:
                group = dist.new_group(ranks)
                if rank in ranks:
                    state.groups[name], state.ranks[name] = group, ranks
    _STATE = state
    return grid


def _hybrid_groups(grid: RankGrid, size: int) -> dict[str, list[list[int]]]:
    """HSDP's groups, each a sorted rank list, in an order every rank computes alike. Ranks of
    one DP x CP group (same tp, pp) fall in block dp // size (a shard group, with every cp) and
    place (dp % size, cp) in their block (a replica group)."""
    shards: dict[tuple, list[int]] = {}
    replicas: dict[tuple, list[int]] = {}
    for r in range(grid.world_size):
        c = grid.coords(r)
        block, place = divmod(c["dp"], size)
        shards.setdefault((c["tp"], c["pp"], block), []).append(r)
        replicas.setdefault((c["tp"], c["pp"], place, c["cp"]), []).append(r)
    return {"dp_shard": [shards[k] for k in sorted(shards)], "dp_replica": [replicas[k] for k in sorted(replicas)]}


def has_group(name: str) -> bool:
    return _STATE is not None and name in _STATE.groups


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = None


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def _state() -> _State:
    if _STATE is None:
        raise RuntimeError(
            "parallel state is not initialised: call engine.parallel_state.initialize_model_parallel"
        )
    return _STATE


def get_grid() -> RankGrid:
    return _state().grid


def get_group(name: str) -> dist.ProcessGroup:
    """Process group by name: tp, cp, dp, dp_cp, pp, tp_cp, mp, ep, etp, edp, etp_ep, embd."""
    return _state().groups[name]


def get_group_ranks(name: str) -> list[int]:
    return _state().ranks[name]


def get_rank_in(name: str) -> int:
    return _state().ranks[name].index(_state().rank)


def get_size_of(name: str) -> int:
    return len(_state().ranks[name])


# Megatron-Core-style getters for the ones layers read on every call.
def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return get_group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return get_size_of("tp") if _STATE is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return get_rank_in("tp") if _STATE is not None else 0


def get_data_parallel_world_size() -> int:
    return get_size_of("dp") if _STATE is not None else 1


def get_data_parallel_rank() -> int:
    return get_rank_in("dp") if _STATE is not None else 0


def get_pipeline_model_parallel_world_size() -> int:
    return get_size_of("pp") if _STATE is not None else 1


def get_pipeline_model_parallel_rank() -> int:
    return get_rank_in("pp") if _STATE is not None else 0


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1
