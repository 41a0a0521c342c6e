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


def test_the_scheduled_placement_pins_a_fixed_job_rank_by_rank():
    from workers.placement import NODE_LABEL, scheduled_selectors

    alive = {"a", "b", "c"}
    pinned = scheduled_selectors({"b": 1, "a": 2}, 3, alive, set(), elastic=False)
    assert pinned == [{NODE_LABEL: "a"}, {NODE_LABEL: "a"}, {NODE_LABEL: "b"}]  # contiguous per node
    assert scheduled_selectors({"a": 2}, 3, alive, set(), elastic=False) is None  # another size
    assert scheduled_selectors({"a": 2, "d": 1}, 3, alive, set(), elastic=False) is None  # a node gone
    assert scheduled_selectors({"a": 2, "b": 1}, 3, alive, {"b"}, elastic=False) is None  # blocked
    assert scheduled_selectors(None, 3, alive, set(), elastic=False) is None


def test_an_elastic_job_is_kept_to_its_usable_nodes():
    from workers.placement import NODE_LABEL, scheduled_selectors

    assert scheduled_selectors({"b": 1, "a": 2}, 3, {"a", "b"}, set(), elastic=True) == {NODE_LABEL: "in(a,b)"}
    assert scheduled_selectors({"b": 1, "a": 2}, 3, {"a"}, set(), elastic=True) == {NODE_LABEL: "in(a)"}
    assert scheduled_selectors({"a": 2}, 2, {"a"}, {"a"}, elastic=True) is None


def test_the_placement_comes_from_the_environment(monkeypatch):
    from engine.jobspec import contract
    from workers.placement import placement_from_env

    monkeypatch.setenv(contract.ENV_PLACEMENT, '{"n1":2,"n2":1}')
    assert placement_from_env() == {"n1": 2, "n2": 1}
    for bad in ("", "[1]", '{"n1":"2"}', "not json"):
        monkeypatch.setenv(contract.ENV_PLACEMENT, bad)
        assert placement_from_env() is None
