"""The in-memory snapshot holder's bookkeeping and the replica placement (no Ray: the actor class
is plain Python; tests/workers/test_ray_recovery.py runs it on a cluster)."""

from __future__ import annotations

from workers.snapshots import KEEP, SnapshotHolder, replica_nodes


def test_holder_keeps_the_newest_per_rank_and_forgets_other_timelines():
    h = SnapshotHolder("job", "node-a")
    for it in (1, 2, 3):
        h.put(0, it, 2, "L", b"rank0-%d" % it)
        h.put(1, it, 2, "L", b"rank1-%d" % it)
    assert KEEP == 2 and h.available(0, 2, "L") == [3, 2]
    assert h.get(1, 3) == b"rank1-3" and h.get(1, 1) is None
    assert h.available(0, 4, "L") == [] and h.available(0, 2, "other layout") == []
    h.forget_after(2)  # the group resumed from 2: 3 belongs to a timeline that was abandoned
    assert h.available(1, 2, "L") == [2]
    h.put(0, 9, 1, "M", b"resized")  # a group of another shape: the old snapshots go
    assert h.available(1, 2, "L") == [] and h.available(0, 1, "M") == [9]


def test_replicas_go_to_the_next_nodes_never_to_the_own_one():
    nodes = ["a", "b", "c"]
    assert replica_nodes("b", nodes, 1) == ["c"]
    assert replica_nodes("c", nodes, 1) == ["a"]
    assert replica_nodes("c", nodes, 5) == ["a", "b"]
    assert replica_nodes("a", ["a", "a"], 1) == []  # one node: own copy only
    assert replica_nodes("a", nodes, 0) == []
