"""The queue on a real Ray cluster, through the service (the shared test cluster: two 1-CPU
nodes, so two 1-rank jobs at once):

- order: while a 2-rank job holds the cluster, alice queues a0 (priority 0) then a5 (priority
  5) and bob b0 (priority 0); when it ends a5 starts first (priority), then b0 ahead of alice's
  earlier a0 (fair share: alice already holds a rank, bob none), and a0 only when a rank frees;
- quota: bob may hold 1 rank; while his b-long runs, his urgent b-hi (priority 10) waits with
  that reason although a rank is free, and alice's priority-0 a-low takes it; a job that could
  never fit bob's quota is refused with a 422 naming the numbers.

Ray's placement groups are sampled throughout: never more than the cluster's 2 CPUs held, and
none waits for room the scheduler believed free. About 90 s on a 2-core machine beyond the
shared cluster's start."""

from __future__ import annotations

from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.service_on_ray import JobView, PlacementSampler, service_on_ray


def _spec(name: str, iters: int = 4, ranks: int = 1, priority: int = 0) -> dict:
    return job(
        name=name,
        training={"train_iters": iters, "log_interval": 2},
        resources={"ranks": ranks},
        scheduling={"priority": priority},
    )


def test_priority_fair_share_and_quota_order_on_ray(ray_cluster, tmp_path):
    with (
        service_on_ray(ray_cluster, tmp_path) as service,
        service.client("admin") as admin,
        service.client("alice") as a_api,
        service.client("bob") as b_api,
        PlacementSampler() as sampler,
    ):
        assert admin.put("/v1/tenants/bob/quota", json={"ranks": 1}).status_code == 200
        wait_for(lambda: service.server.ctx.reconciler.capacity, 60, "the scheduler's first read of the cluster")
        alice, bob = JobView(a_api), JobView(b_api)
        refused = b_api.post("/v1/jobs", json=_spec("too-big", ranks=2))
        assert refused.status_code == 422 and "quota" in refused.text, refused.text

        holder = alice.submit(_spec("holder", iters=16, ranks=2))["id"]
        wait_for(lambda: (alice.get(holder)["iteration"] or 0) >= 1, 240, "the holder running")
        a0 = alice.submit(_spec("a0", iters=8))["id"]
        a5 = alice.submit(_spec("a5", iters=8, priority=5))["id"]
        b0 = bob.submit(_spec("b0", iters=8))["id"]
        # (fair share counts what runs: the holder is alice's, so bob's b0 goes before alice's a0)
        in_order = [a5, b0, a0]
        wait_for(lambda: [j["id"] for j in admin.get("/v1/queue").json()["jobs"]] == in_order, 30, "the order")
        for j, view in ((a0, alice), (a5, alice), (b0, bob)):
            assert view.state(j, "succeeded", "failed", timeout=300)["state"] == "succeeded"
        start = {j: view.events(j, "admitted")[0]["id"] for j, view in ((a0, alice), (a5, alice), (b0, bob))}
        assert start[a5] <= start[b0] < start[a0], start

        long = bob.submit(_spec("b-long", iters=60))["id"]
        wait_for(lambda: (bob.get(long)["iteration"] or 0) >= 1, 240, "bob's long job running")
        hi = bob.submit(_spec("b-hi", priority=10))["id"]
        low = alice.submit(_spec("a-low"))["id"]
        wait_for(lambda: alice.events(low, "admitted"), 60, "alice's job admitted into the free rank")
        waiting = bob.get(hi)
        assert waiting["state"] == "queued" and waiting["waiting_reason"].startswith("tenant bob at its quota"), waiting
        assert bob.get(long)["state"] in ("starting", "running"), "b-long ended: the quota was not what held b-hi"
        assert alice.state(low, "succeeded", "failed", timeout=240)["state"] == "succeeded"
        assert bob.state(hi, "succeeded", "failed", timeout=300)["state"] == "succeeded"
        assert bob.events(hi, "admitted")[0]["id"] > alice.events(low, "admitted")[0]["id"]
    placed = sampler.check(cpus=2.0)
    print(f"admitted {sorted(start, key=start.get)}; b-hi waited: {waiting['waiting_reason']!r}; {placed}")
