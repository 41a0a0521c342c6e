"""The shared cluster's leak guard (tests/ray_cluster.py) can fail: an actor, a placement group
and a Ray job started here and left alive are each named by it, and its clean-up removes them
(else every test after this one would fail the guard too); a worker node a test removed and did
not add back is put back."""

from __future__ import annotations

import ray
from ray.job_submission import JobSubmissionClient
from ray.util.placement_group import placement_group

from tests.ray_cluster import WORKER_NODES, left_behind, leftovers, remove, restore_worker_nodes, worker_nodes
from tests.waiting import wait_for


@ray.remote(num_cpus=0)
class ForgottenActor:
    def ping(self) -> str:
        return "pong"


def test_an_actor_a_placement_group_and_a_job_left_alive_fail_the_guard(ray_cluster):
    before = leftovers(ray_cluster)
    assert not left_behind(ray_cluster, before, grace_s=0)  # nothing new yet: the guard passes

    actor = ForgottenActor.remote()
    assert ray.get(actor.ping.remote(), timeout=60) == "pong"
    group = placement_group([{"CPU": 1}])
    ray.get(group.ready(), timeout=60)
    jobs = JobSubmissionClient(f"http://{ray_cluster.webui_url}")
    job = jobs.submit_job(entrypoint="sleep 300")
    wait_for(lambda: str(jobs.get_job_status(job)) == "RUNNING", 60, "the forgotten Ray job running")

    left = left_behind(ray_cluster, before, grace_s=1.0)
    described = left.describe()
    assert "actor ForgottenActor" in described, described
    assert group.id.hex() in left.placement_groups, described
    assert left.jobs == {job: "RUNNING"}, described

    remove(ray_cluster, left)
    assert not left_behind(ray_cluster, before), leftovers(ray_cluster).since(before).describe()


def test_a_removed_worker_node_is_put_back(ray_cluster):
    assert restore_worker_nodes(ray_cluster) == 0  # the shape every Ray test starts from
    ray_cluster.remove_node(worker_nodes(ray_cluster)[-1], allow_graceful=False)
    assert len(worker_nodes(ray_cluster)) == WORKER_NODES - 1

    assert restore_worker_nodes(ray_cluster) == 1
    alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
    assert len(worker_nodes(ray_cluster)) == len(alive) == WORKER_NODES
