"""The scheduler's view of a real Ray cluster: RayJobsLauncher.capacity() reads the shared test
cluster's nodes (conftest.py: a head without CPUs and two one-CPU nodes) over the dashboard's
State API, as the API process does (no ray.init there), and the per-rank rule the driver asks
Ray for is the one the scheduler counts."""

from __future__ import annotations

from engine.jobspec.demand import rank_resources
from service.launcher import RayJobsLauncher
from tests.ray_cluster import worker_nodes


def test_capacity_lists_the_clusters_nodes_with_their_cpus(ray_cluster):
    launcher = RayJobsLauncher(f"http://{ray_cluster.webui_url}", timeout_s=30)
    nodes = launcher.capacity()
    alive = {n.id: n for n in nodes if n.alive}
    workers = {n.node_id for n in worker_nodes(ray_cluster)}
    assert workers <= set(alive)
    assert sorted(alive[i].cpus for i in workers) == [1.0, 1.0]
    assert alive[ray_cluster.head_node.node_id].cpus == 0.0
    assert sum(n.cpus for n in alive.values()) == 2.0 and all(n.gpus == 0 for n in nodes)
    assert rank_resources(False) == {"CPU": 1.0}  # what one rank of a CPU job asks Ray for
