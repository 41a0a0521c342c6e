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
    driver = SimpleNamespace(spec=spec, job=resolve_job(spec), events=_Events(), registry=_Registry())
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
