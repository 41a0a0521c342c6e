"""The rank grid: group lists worked out by hand for Megatron-Core's order tp-cp-ep-dp-pp (TP
innermost, rank = tp + TP*(cp + CP*(dp + DP*pp))) and its expert grid etp-ep-edp-pp; every group
family partitions the ranks; impossible layouts are refused with a clear message; and the process
groups built on real gloo ranks match the grid.
"""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine import parallel_state as ps
from engine.launcher import spawn
from engine.parallel_state import LayoutError, RankGrid

# --- 16 ranks, TP=2, PP=4 (DP=2): Megatron-Core's docstring example ----------------------------


@pytest.fixture
def tp2_pp4() -> RankGrid:
    return RankGrid(world_size=16, tp=2, pp=4)


def test_tp2_pp4_sizes(tp2_pp4):
    assert (tp2_pp4.tp, tp2_pp4.pp, tp2_pp4.cp, tp2_pp4.dp) == (2, 4, 1, 2)


def test_tp2_pp4_tensor_groups(tp2_pp4):
    assert tp2_pp4.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]


def test_tp2_pp4_data_groups(tp2_pp4):
    assert tp2_pp4.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    # context 1: data x context is plain data parallel
    assert tp2_pp4.groups("dp", "cp") == tp2_pp4.groups("dp")


def test_tp2_pp4_pipeline_groups(tp2_pp4):
    assert tp2_pp4.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_tp2_pp4_model_parallel_groups(tp2_pp4):
    # tensor x pipeline: every rank with the same data-parallel index
    assert tp2_pp4.groups("tp", "pp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_tp2_pp4_embedding_groups(tp2_pp4):
    # first and last stage of each pipeline group
    assert tp2_pp4.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_embedding_groups_without_pipeline_are_single_ranks():
    assert RankGrid(world_size=4, tp=2).embedding_groups() == [[0], [1], [2], [3]]


def test_tp2_pp4_coords(tp2_pp4):
    assert tp2_pp4.coords(0) == {"tp": 0, "cp": 0, "dp": 0, "pp": 0}
    assert tp2_pp4.coords(6) == {"tp": 0, "cp": 0, "dp": 1, "pp": 1}  # 6 = 0 + 2*(1 + 2*1)
    assert tp2_pp4.coords(13) == {"tp": 1, "cp": 0, "dp": 0, "pp": 3}  # 13 = 1 + 2*(0 + 2*3)
    assert tp2_pp4.coords(15) == {"tp": 1, "cp": 0, "dp": 1, "pp": 3}


# --- 8 ranks, TP=2, CP=2 (DP=2): rank = tp + 2*cp + 4*dp -------------------------------------


@pytest.fixture
def tp2_cp2() -> RankGrid:
    return RankGrid(world_size=8, tp=2, cp=2)


def test_tp2_cp2_groups(tp2_cp2):
    assert tp2_cp2.dp == 2
    assert tp2_cp2.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tp2_cp2.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert tp2_cp2.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tp2_cp2.groups("dp", "cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert tp2_cp2.groups("tp", "cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tp2_cp2.groups("pp") == [[0], [1], [2], [3], [4], [5], [6], [7]]


def test_tp2_cp2_coords(tp2_cp2):
    assert tp2_cp2.coords(5) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0}  # 5 = 1 + 2*0 + 4*1
    assert tp2_cp2.coords(6) == {"tp": 0, "cp": 1, "dp": 1, "pp": 0}  # 6 = 0 + 2*1 + 4*1


# --- a non-default order: tp-cp-ep-pp-dp (pipeline inside data parallel) ----------------------


def test_pipeline_inside_data_order():
    # 8 ranks, TP=2, PP=2, DP=2: rank = tp + 2*pp + 4*dp
    grid = RankGrid(world_size=8, tp=2, pp=2, order=("tp", "cp", "ep", "pp", "dp"))
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.embedding_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.coords(6) == {"tp": 0, "cp": 0, "pp": 1, "dp": 1}


# --- expert grid: etp-ep-edp-pp ----------------------------------------------------------------


def test_expert_grid_tp2_ep2():
    # 8 ranks, tp 2 (expert tp 2 by default), ep 2: expert dp = 8 / (2*2*1) = 2;
    # expert rank = etp + 2*ep + 4*edp
    grid = RankGrid(world_size=8, tp=2, ep=2)
    assert (grid.expert_tp, grid.expert_dp, grid.dp) == (2, 2, 4)
    assert grid.expert_groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.expert_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.expert_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.expert_groups("tp", "ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # The dense grid ignores ep: data parallel is 4 wide.
    assert grid.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_expert_grid_with_its_own_tensor_size():
    # 8 ranks, dense tp 2, expert tp 1, ep 4: expert dp = 8 / (1*4*1) = 2; expert rank = ep + 4*edp
    grid = RankGrid(world_size=8, tp=2, ep=4, etp=1)
    assert (grid.expert_tp, grid.expert_dp) == (1, 2)
    assert grid.expert_groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.expert_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.expert_groups("tp") == [[r] for r in range(8)]
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_expert_grid_shares_pipeline_groups():
    # 8 ranks, pp 2, ep 2: dense rank = dp + 4*pp (dp 4); expert rank = ep + 2*edp + 4*pp (edp 2)
    grid = RankGrid(world_size=8, pp=2, ep=2)
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.expert_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.expert_groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.expert_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_order_whose_expert_pipeline_groups_differ_is_refused():
    # order tp-pp-cp-ep-dp, tp 2, expert tp 1: dense pp groups [0,2],[1,3],... but expert pp
    # groups [0,1],[2,3],...: an expert group would span two pipeline stages.
    with pytest.raises(LayoutError):
        RankGrid(world_size=8, tp=2, pp=2, etp=1, order=("tp", "pp", "cp", "ep", "dp"))


def test_parallel_folding_expert_across_tensor_ranks():
    # attention TP 4, experts EP 8 with expert TP 1 on 8 ranks
    grid = RankGrid(world_size=8, tp=4, ep=8, etp=1)
    assert grid.expert_groups("ep") == [[0, 1, 2, 3, 4, 5, 6, 7]]


# --- every group family partitions the ranks ---------------------------------------------------

DENSE_FAMILIES = [("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp"), ("tp", "cp"), ("tp", "pp")]
EXPERT_FAMILIES = [("ep",), ("tp",), ("dp",), ("pp",), ("tp", "ep")]


def _check_partition(groups: list[list[int]], world: int, size: int, label: str) -> None:
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(world)), f"{label}: not a partition of {world} ranks: {groups}"
    assert all(len(g) == size for g in groups), f"{label}: expected groups of {size}: {groups}"
    assert all(g == sorted(g) for g in groups), f"{label}: unsorted group in {groups}"


@st.composite
def layouts(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    pp = draw(st.sampled_from([1, 2, 3]))
    world = tp * cp * dp * pp
    ep = draw(st.sampled_from([e for e in range(1, dp * cp + 1) if (dp * cp) % e == 0]))
    etp = draw(st.sampled_from([None] + [t for t in (1, 2, 4) if world % (t * ep * pp) == 0]))
    order = draw(st.sampled_from([("tp", "cp", "ep", "dp", "pp"), ("tp", "cp", "ep", "pp", "dp")]))
    # With pp before dp, dense rank = tp-cp block + (tp*cp) * pp + ..., expert rank = etp-ep block
    # + (etp*ep) * pp + ...: the two grids share pipeline groups only if those blocks are equal.
    if order[3] == "pp" and pp > 1:
        assume((etp or tp) * ep == tp * cp)
    return RankGrid(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_family_partitions_the_ranks(grid):
    w = grid.world_size
    dense = {"tp": grid.tp, "cp": grid.cp, "dp": grid.dp, "pp": grid.pp}
    for dims in DENSE_FAMILIES:
        size = math.prod(dense[d] for d in dims)
        groups = grid.groups(*dims)
        _check_partition(groups, w, size, f"dense {dims}")
        # Ranks in one group agree on every other coordinate and differ along `dims`.
        for g in groups:
            others = {tuple(v for k, v in grid.coords(r).items() if k not in dims) for r in g}
            assert len(others) == 1, f"dense {dims}: group {g} mixes coordinates {others}"
            along = {tuple(grid.coords(r)[d] for d in dims) for r in g}
            assert len(along) == len(g), f"dense {dims}: group {g} repeats a position"
    expert = {"tp": grid.expert_tp, "ep": grid.ep, "dp": grid.expert_dp, "pp": grid.pp}
    assert grid.expert_tp * grid.ep * grid.expert_dp * grid.pp == w
    for dims in EXPERT_FAMILIES:
        _check_partition(grid.expert_groups(*dims), w, math.prod(expert[d] for d in dims), f"expert {dims}")
    embd = grid.embedding_groups()
    assert sorted(r for g in embd for r in g) == sorted(
        {g[0] for g in grid.groups("pp")} | {g[-1] for g in grid.groups("pp")}
    )


@pytest.mark.parametrize(
    ("kwargs", "dp"),
    [
        ({"world_size": 1}, 1),
        ({"world_size": 8}, 8),
        ({"world_size": 8, "tp": 2}, 4),
        ({"world_size": 16, "tp": 2, "pp": 2, "cp": 2}, 2),
        ({"world_size": 12, "tp": 2, "pp": 3}, 2),
        ({"world_size": 8, "ep": 4}, 8),
    ],
)
def test_data_parallel_size(kwargs, dp):
    assert RankGrid(**kwargs).dp == dp


def test_unknown_dimension_is_a_key_error():
    with pytest.raises(KeyError, match=r"unknown parallel dimension\(s\) \['ep'\]"):
        RankGrid(world_size=4).groups("ep")
    with pytest.raises(KeyError, match=r"unknown parallel dimension\(s\) \['cp'\]"):
        RankGrid(world_size=4).expert_groups("cp")


# --- impossible layouts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"world_size": 6, "tp": 4},
            r"^tensor \(4\) x pipeline \(1\) x context \(1\) = 4 does not divide the 6 ranks$",
        ),
        (
            {"world_size": 12, "tp": 2, "pp": 2, "cp": 2},
            r"^tensor \(2\) x pipeline \(2\) x context \(2\) = 8 does not divide the 12 ranks$",
        ),
        (
            {"world_size": 4, "ep": 3},
            r"^expert tensor \(1\) x expert \(3\) x pipeline \(1\) does not divide the 4 ranks$",
        ),
        (
            {"world_size": 8, "tp": 2, "ep": 8},
            r"^expert tensor \(2\) x expert \(8\) x pipeline \(1\) does not divide the 8 ranks$",
        ),
        (
            {"world_size": 8, "etp": 3},
            r"^expert tensor \(3\) x expert \(1\) x pipeline \(1\) does not divide the 8 ranks$",
        ),
        ({"world_size": 4, "vpp": 2}, r"^virtual pipeline needs pipeline > 1$"),
        ({"world_size": 0}, r"^world_size must be >= 1, got 0$"),
        ({"world_size": 4, "tp": 0}, r"^tp must be >= 1, got 0$"),
        ({"world_size": 4, "pp": -1}, r"^pp must be >= 1, got -1$"),
        ({"world_size": 4, "cp": 0}, r"^cp must be >= 1, got 0$"),
        ({"world_size": 4, "ep": 0}, r"^ep must be >= 1, got 0$"),
        (
            {"world_size": 4, "order": ("tp", "cp", "dp", "pp")},
            r"^order must be a permutation of tp-cp-ep-dp-pp, got tp-cp-dp-pp$",
        ),
        (
            {"world_size": 4, "order": ("tp", "tp", "ep", "dp", "pp")},
            r"^order must be a permutation of tp-cp-ep-dp-pp, got tp-tp-ep-dp-pp$",
        ),
    ],
)
def test_impossible_layouts(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        RankGrid(**kwargs)


def test_layout_error_is_a_value_error():
    assert issubclass(LayoutError, ValueError)


@pytest.mark.parametrize(
    "kwargs", [{"etp": 0}, {"etp": -1}, {"pp": 2, "vpp": 0}], ids=["etp-0", "etp-negative", "vpp-0"]
)
def test_expert_tensor_and_virtual_pipeline_sizes_are_checked(kwargs):
    with pytest.raises(LayoutError):
        RankGrid(world_size=8, **kwargs)


@pytest.mark.parametrize("rank", [16, -1])
def test_coords_of_a_rank_outside_the_world(tp2_pp4, rank):
    with pytest.raises((LayoutError, ValueError, IndexError)):
        tp2_pp4.coords(rank)


# --- process groups on real gloo ranks ---------------------------------------------------------


def _groups_on_rank(tensor: int) -> dict:
    import torch

    ps.initialize_model_parallel(tensor=tensor)
    out = {name: ps.get_group_ranks(name) for name in ("tp", "dp", "pp", "mp", "cp", "dp_cp", "embd")}
    out["tp_rank"] = ps.get_tensor_model_parallel_rank()
    out["tp_size"] = ps.get_tensor_model_parallel_world_size()
    out["dp_rank"] = ps.get_data_parallel_rank()
    out["dp_size"] = ps.get_data_parallel_world_size()
    out["pp_size"] = ps.get_pipeline_model_parallel_world_size()
    out["first_last"] = (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    # The groups are real: a sum over each one adds exactly its members' ranks.
    for name in ("tp", "dp"):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=ps.get_group(name))
        out[f"{name}_sum"] = int(t.item())
    ps.destroy_model_parallel()
    return out


def _initialize_on_rank(tensor: int) -> None:
    ps.initialize_model_parallel(tensor=tensor)


def test_initialize_model_parallel_on_four_ranks():
    results = spawn(_groups_on_rank, 4, args=(2,))
    # 4 ranks, tensor 2: rank = tp + 2*dp
    expected_tp = [[0, 1], [0, 1], [2, 3], [2, 3]]
    expected_dp = [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["tp"] for r in results] == expected_tp
    assert [r["dp"] for r in results] == expected_dp
    assert [r["pp"] for r in results] == [[0], [1], [2], [3]]
    assert [r["mp"] for r in results] == expected_tp
    assert [r["cp"] for r in results] == [[0], [1], [2], [3]]
    assert [r["dp_cp"] for r in results] == expected_dp
    assert [r["embd"] for r in results] == [[0], [1], [2], [3]]
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1]
    assert [r["tp_size"] for r in results] == [2, 2, 2, 2]
    assert [r["dp_rank"] for r in results] == [0, 0, 1, 1]
    assert [r["dp_size"] for r in results] == [2, 2, 2, 2]
    assert [r["pp_size"] for r in results] == [1, 1, 1, 1]
    assert [r["first_last"] for r in results] == [(True, True)] * 4
    assert [r["tp_sum"] for r in results] == [1, 1, 5, 5]  # 0+1, 2+3
    assert [r["dp_sum"] for r in results] == [2, 4, 2, 4]  # 0+2, 1+3

    # and the same lists as the pure grid gives
    grid = RankGrid(world_size=4, tp=2)
    for rank, r in enumerate(results):
        for name, dims in [("tp", ("tp",)), ("dp", ("dp",)), ("pp", ("pp",)), ("mp", ("tp", "pp"))]:
            (mine,) = [g for g in grid.groups(*dims) if rank in g]
            assert r[name] == mine, (rank, name)


def test_initialize_model_parallel_refuses_an_impossible_layout():
    from engine.launcher import RankFailure

    with pytest.raises(RankFailure, match=r"LayoutError: tensor \(3\) x pipeline \(1\) x context \(1\) = 3"):
        spawn(_initialize_on_rank, 2, args=(3,))


def test_getters_before_initialisation():
    ps.destroy_model_parallel()
    assert ps.model_parallel_is_initialized() is False
    pattern = r"parallel state is not initialised: call engine\.parallel_state\.initialize_model_parallel"
    for getter, args in [
        (ps.get_group_ranks, ("tp",)),
        (ps.get_rank_in, ("dp",)),
        (ps.get_size_of, ("pp",)),
        (ps.get_group, ("tp",)),
        (ps.get_grid, ()),
        (ps.get_tensor_model_parallel_group, ()),
    ]:
        with pytest.raises(RuntimeError, match=pattern):
            getter(*args)
    # The size/rank getters that layers call on every step fall back to a single rank.
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_data_parallel_world_size() == 1
    assert ps.get_pipeline_model_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()


def test_initialize_without_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        ps.initialize_model_parallel(tensor=1)


# --- hybrid sharding (HSDP) groups, worked out by hand --------------------------------------------


def test_hybrid_groups_without_context_split_each_dp_group():
    """8 ranks, TP=2 (DP=4), shard size 2: DP group [0,2,4,6] -> shards [0,2], [4,6]; replicas
    pair the same place in each shard: [0,4], [2,6]."""
    groups = ps._hybrid_groups(RankGrid(world_size=8, tp=2), 2)
    assert groups["dp_shard"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups["dp_replica"] == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_hybrid_groups_with_context_take_the_cp_peers_along():
    """8 ranks, CP=2 (DP=4; rank = cp + 2*dp), shard size 2: a shard group is 2 DP ranks with
    both of their CP ranks (what the DP x CP reduction shards over), a replica the same (dp
    place, cp) in each block; each family partitions the ranks."""
    groups = ps._hybrid_groups(RankGrid(world_size=8, cp=2), 2)
    assert groups["dp_shard"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["dp_replica"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for family in groups.values():
        assert sorted(r for g in family for r in g) == list(range(8))
