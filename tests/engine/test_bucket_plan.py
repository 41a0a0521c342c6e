"""The pure bucket planner (engine/distributed/bucket_plan.py) and the table of sharding levels
(engine/distributed/sharding.py): the plan's invariants on any input, the rules it follows on
hand-checked examples, and each level's strategies on one process."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from engine.distributed.bucket_plan import ROOT_UNIT, ParamSlot, plan_buckets
from engine.distributed.data_parallel import DataParallel
from engine.distributed.sharding import LEVELS, SHARDING_LEVELS, FlatBuffer, InPlace, StagedGrads, UnitShards


def _unit(slot: ParamSlot) -> int:
    return slot.unit if slot.unit is not None else ROOT_UNIT


@st.composite
def _inputs(draw):
    units = draw(st.one_of(st.none(), st.integers(0, 3)))
    slot = st.builds(
        ParamSlot,
        numel=st.integers(1, 40),
        expert=st.booleans(),
        tied=st.integers(0, 9).map(lambda n: n == 0),  # rare, like the one tied embedding
        unit=st.none() if not units else st.one_of(st.none(), st.integers(0, units - 1)),
    )
    params = draw(st.lists(slot, min_size=1, max_size=25))
    return params, draw(st.integers(1, 120)), draw(st.integers(1, 8)), draw(st.integers(1, 4)), units


@settings(max_examples=200, deadline=None)
@given(_inputs())
def test_the_plan_keeps_its_invariants(inputs):
    params, bucket_size, world, expert_world, units = inputs
    layout = plan_buckets(params, bucket_size, world=world, expert_world=expert_world, units=units)
    seen: list[int] = []
    offset = 0
    for b in layout.buckets:
        # Buckets tile the buffer; segments tile the bucket from its start, padding at the end.
        assert b.offset == offset and b.segments
        offset += b.numel
        at = b.offset
        for s in b.segments:
            assert s.offset == at and s.numel == params[s.param].numel
            at += s.numel
        assert b.world == (expert_world if b.expert else world)
        assert b.numel % b.world == 0 and 0 <= b.padding < b.world and at + b.padding == b.offset + b.numel
        # One kind, one unit per bucket; a tied parameter alone; a bucket closes on reaching the size.
        assert all(params[s.param].expert == b.expert for s in b.segments)
        if units is not None:
            assert all(_unit(params[s.param]) == b.unit for s in b.segments)
        if any(params[s.param].tied for s in b.segments):
            assert len(b.segments) == 1
        assert sum(s.numel for s in b.segments[:-1]) < bucket_size
        # The group's shards tile the bucket.
        ranges = [b.shard_range(r) for r in range(b.world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == b.numel
        assert all(hi == lo for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False))
        seen += [s.param for s in b.segments]
    assert sorted(seen) == list(range(len(params))), "every parameter in exactly one bucket"
    assert layout.numel == offset

    # What the ranks own: every element of every parameter exactly once over each group.
    covered = {i: [0] * p.numel for i, p in enumerate(params)}
    for rank in range(max(world, expert_world)):
        for o in layout.owned(rank, rank, sharded=True):
            b = layout.buckets[o.bucket]
            if rank >= b.world:
                continue  # no such rank in this bucket's group
            seg = next(s for s in b.segments if s.param == o.param)
            assert seg.offset + o.lo == b.offset + b.shard_range(rank)[0] + o.shard_offset
            assert o.shard_offset + (o.hi - o.lo) <= b.shard_numel
            for k in range(o.lo, o.hi):
                covered[o.param][k] += 1
    assert all(c == 1 for counts in covered.values() for c in counts)
    whole = layout.owned(0, 0, sharded=False)
    assert sorted((o.param, o.lo, o.hi) for o in whole) == [(i, 0, p.numel) for i, p in enumerate(params)]


def _layout(sizes, **kw):
    kw.setdefault("world", 1)
    slots = [s if isinstance(s, ParamSlot) else ParamSlot(s) for s in sizes]
    return plan_buckets(slots, kw.pop("bucket_size"), **kw)


def test_buckets_fill_in_reverse_order_and_pad_to_the_group():
    layout = _layout([10, 3, 7], bucket_size=8, world=4)
    assert [[s.param for s in b.segments] for b in layout.buckets] == [[2, 1], [0]]
    assert [(b.offset, b.numel, b.padding) for b in layout.buckets] == [(0, 12, 2), (12, 12, 2)]
    assert [b.shard_range(3) for b in layout.buckets] == [(9, 12), (9, 12)]
    # Rank 1 owns elements 3..6 of bucket 0: all of them in param 2 (7 elements).
    assert [(o.param, o.lo, o.hi, o.shard_offset) for o in layout.owned(1, 0, sharded=True)] == [
        (2, 3, 6, 0),
        (0, 3, 6, 0),
    ]


def test_experts_and_tied_embeddings_get_buckets_of_their_own():
    slots = [ParamSlot(5, tied=True), ParamSlot(4), ParamSlot(6, expert=True), ParamSlot(4)]
    layout = _layout(slots, bucket_size=100, world=2, expert_world=3)
    got = [([s.param for s in b.segments], b.expert, b.numel) for b in layout.buckets]
    assert got == [([3, 1], False, 8), ([0], False, 6), ([2], True, 6)]


def test_by_unit_the_last_layer_comes_first_then_the_root_and_experts_lead_each_unit():
    slots = [ParamSlot(3), ParamSlot(2, unit=0), ParamSlot(2, unit=1), ParamSlot(4, expert=True, unit=1)]
    layout = _layout(slots, bucket_size=100, world=2, expert_world=1, units=2)
    got = [(b.unit, b.expert, [s.param for s in b.segments]) for b in layout.buckets]
    assert got == [(1, True, [3]), (1, False, [2]), (0, False, [1]), (ROOT_UNIT, False, [0])]


def test_the_table_of_levels():
    shards = {name: (lv.shards_optimizer, lv.shards_grads, lv.shards_params) for name, lv in LEVELS.items()}
    assert SHARDING_LEVELS == ("none", "optim", "optim_grads", "optim_grads_params")
    assert shards == {
        "none": (False, False, False),
        "optim": (True, False, False),
        "optim_grads": (True, True, False),
        "optim_grads_params": (True, True, True),
    }
    assert [LEVELS[n].params for n in SHARDING_LEVELS] == [InPlace, FlatBuffer, FlatBuffer, UnitShards]
    assert isinstance(LEVELS["optim_grads"].grads(), StagedGrads)


def _grads(ddp: nn.Module, model: nn.Module, x: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    ddp.start_step(microbatches)
    for k in range(microbatches):
        (model(x[k]).pow(2).mean() / microbatches).backward()
    ddp.finish_grad_sync()
    return [g.clone() for g in ddp.grad_views()]


@pytest.mark.parametrize("level", SHARDING_LEVELS)
def test_every_level_on_one_rank_gives_autograd_gradients(level):
    """With no data-parallel group every level keeps whole gradients of the right values, and
    the optimizer's views cover every parameter; ZeRO-3 with nothing to shard falls back to
    keeping parameters whole (optim_grads)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    reference = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    reference.load_state_dict(model.state_dict())
    ddp = DataParallel(model, None, sharding=level, bucket_size=20)
    x = torch.randn(2, 4, 6)
    got = _grads(ddp, model, x, 2)
    for k in range(2):
        (reference(x[k]).pow(2).mean() / 2).backward()
    twin = {id(p): r for p, r in zip(model.parameters(), reference.parameters(), strict=True)}
    segments = ddp.param_shard_ranges()  # in bucket order: last layer first
    assert sorted(id(p) for p, _, _ in segments) == sorted(twin)
    assert all((lo, hi) == (0, p.numel()) for p, lo, hi in segments)
    want = [twin[id(p)].grad.view(-1)[lo:hi] for p, lo, hi in segments]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert not ddp.shard_params and ddp.shard == (level != "none") and ddp.shard_grads == level.startswith("optim_grads")
    view = ddp.checkpoint_view()
    assert not view.params_sharded and view.shards == ()
    assert all(view.holding(p).state_group is None for p in model.parameters())
