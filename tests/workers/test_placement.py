"""Sticky placement (workers/placement.py): the selectors that send each restarted rank back to
its node. The real-cluster proof is tests/workers/test_ray_recovery.py (a killed rank's group
comes back on the same nodes and recovers from `memory`)."""

from __future__ import annotations

from workers.placement import exclusion, sticky_selectors

GROUP = {"attempt": 0, "ranks": [{"rank": 0, "node_id": "a"}, {"rank": 1, "node_id": "a"}, {"rank": 2, "node_id": "b"}]}


def test_every_rank_is_pinned_to_its_node_when_all_are_there():
    got = sticky_selectors(GROUP, 1, 3, alive={"a", "b", "c"}, blocked=set())
    assert got == [{"ray.io/node-id": "a"}, {"ray.io/node-id": "a"}, {"ray.io/node-id": "b"}]


def test_a_lost_or_blocked_node_frees_only_its_ranks():
    lost = sticky_selectors(GROUP, 1, 3, alive={"a", "c"}, blocked=set())
    assert lost == [{"ray.io/node-id": "a"}, {"ray.io/node-id": "a"}, {}]
    blocked = sticky_selectors(GROUP, 1, 3, alive={"a", "b"}, blocked={"a"})
    assert blocked == [{"ray.io/node-id": "!in(a)"}, {"ray.io/node-id": "!in(a)"}, {"ray.io/node-id": "b"}]


def test_placed_freely_without_a_group_just_before_of_this_size_or_any_node_left():
    assert sticky_selectors(None, 1, 3, {"a", "b"}, set()) is None
    assert sticky_selectors(GROUP, 2, 3, {"a", "b"}, set()) is None  # attempt 1 never started a group
    assert sticky_selectors(GROUP, 1, 4, {"a", "b"}, set()) is None
    assert sticky_selectors(GROUP, 1, 3, {"c"}, set()) is None
    assert exclusion(set()) is None and exclusion({"b", "a"}) == {"ray.io/node-id": "!in(a,b)"}
