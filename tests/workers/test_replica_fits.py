"""resilience.resize: live, the driver's side without Ray: which resizes it refuses (naming the
numbers) and what it releases. The resize itself on Ray: test_ray_live_resize.py."""

from __future__ import annotations

from types import SimpleNamespace

from engine.jobspec import parse_job
from engine.jobspec.resolved import resolve_job
from tests.workers.conftest import job
from workers.replica_fits import ReplicaFits


class _Events:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    def event(self, kind: str, **fields) -> None:
        self.sent.append((kind, fields))


class _Registry:
    def __init__(self) -> None:
        self.released: list[int] = []
        self.release = SimpleNamespace(remote=lambda slot, released=True: released and self.released.append(slot))


def _fits(**resources) -> ReplicaFits:
    spec = parse_job(
        job(
            resources={"ranks": 4, "min_ranks": 2, **resources},
            training={"global_batch_size": 8},
            parallel={"data_parallel_sharding": "optim_grads_params", "data_parallel_shard_size": 2},
            resilience={"on_rank_failure": "replace_replica", "resize": "live"},
        )
    )
    policy = SimpleNamespace(max_restarts=2, restarts_used=0)
    driver = SimpleNamespace(spec=spec, job=resolve_job(spec), events=_Events(), registry=_Registry(), policy=policy)
    return ReplicaFits(driver, 0)


def test_a_resize_outside_the_jobs_replica_groups_is_refused_with_the_numbers():
    fits = _fits()
    assert (fits.size, fits.count, fits.fewest, fits.target) == (2, 2, 1, 2)
    why = fits.resize(0)
    assert why == (
        "asked for 0 replica groups; this job runs at least 1 (resources.min_ranks = 2 ranks, 2 a group)"
    )
    why = fits.resize(3)
    assert why == "asked for 3 replica groups; this job has 2 data slots (resources.max_ranks = 4 ranks, 2 a group)"
    assert [k for k, _ in fits.driver.events.sent] == ["resize_refused", "resize_refused"]
    assert fits.driver.events.sent[0][1]["replicas"] == 0
    assert fits.resizing is None and fits.target == 2  # nothing changed


def test_a_shrink_releases_the_highest_running_slots_and_one_resize_at_a_time():
    fits = _fits()
    for slot in fits.slots:
        slot.state = "running"
    assert fits.resize(1) is None
    assert fits.driver.registry.released == [1] and fits.slots[1].released and not fits.slots[0].released
    assert (fits.resizing.from_replicas, fits.resizing.to_replicas, fits.resizing.slots) == (2, 1, [1])
    why = fits.resize(2)
    assert why == "asked for 2 replica groups while a resize to 1 is in flight"
    assert fits.target == 1


def test_a_group_that_fails_before_a_shrink_stays_down_and_the_shrink_releases_nothing_else():
    """A resize racing a failure, failure first: replica 1's run failed (waiting for room to be
    started again) when the scheduler asks for one group. One consistent state: replica 0 runs,
    slot 1 is free (not restarted into room the scheduler gave away), nothing released."""
    fits = _fits()
    for slot in fits.slots:
        slot.state = "running"
    fits.slots[1].state, fits.slots[1].error = "failed", RuntimeError("rank died")
    assert fits._on_failure(fits.slots[1]) is None  # one of max_restarts: started again when room returns
    assert fits.slots[1].state == "waiting" and [k for k, _ in fits.driver.events.sent] == ["replica_restarting"]
    assert fits.resize(1) is None
    fits._restart_waiting()
    assert [s.state for s in fits.slots] == ["running", "idle"] and fits.target == 1
    assert fits.driver.registry.released == []  # replica 0 was not asked to leave
    assert fits.resizing.slots == [] and not fits.resizing.grow


def test_a_group_that_fails_while_it_is_released_counts_as_released_not_as_a_failure():
    """The other order: replica 1 is released and its run raises as it leaves (its ranks killed
    mid-exit): the shrink completes, no restart is spent on it."""
    fits = _fits()
    for slot in fits.slots:
        slot.state = "running"
    assert fits.resize(1) is None

    class Dying:
        def fit(self):
            raise RuntimeError("worker died while leaving")

    fits._fit(fits.slots[1], Dying())
    assert fits.slots[1].state == "released" and fits.restarts == 0
    assert not [s for s in fits.slots if s.state == "failed"]
