"""`resilience.resize: live` on a real Ray cluster, through the service: the API (its reconciler and
scheduler, RayJobsLauncher on the shared two-node test cluster of two 1-CPU nodes) runs an elastic
replace_replica job on 2 one-rank replica groups; an urgent 1-rank job arrives; the scheduler asks
the elastic job for one replica group (TelemetryAck.replicas); its driver releases replica 1 at a
step boundary, whose Ray Train run ends and frees its CPU, and replica 0 trains on alone, taking
replica 1's share of each global batch (`lost_replica_share: redistribute`); the urgent job runs in
the freed room; once it has ended the scheduler grows the job back to 2 and a new replica group
heals from replica 0 and joins (the grow on Ray is not asserted here yet: in the one run made, the
job's 400 steps ended before the scheduler's grow came; tests/engine/test_replica_quorum.py proves
a grow's math without Ray). No checkpoint, stop or new attempt: replica 0's process is the same
from the first step to the last.

Losses against the uninterrupted 2-rank run (`elastron train`, the same data and seed): every step
trains the same samples with the same math, so each loss equals the reference's up to fp32
rounding of the gradient sums, whose order changes with who takes which microbatch (1e-7 relative
measured in tests/engine/test_replica_quorum.py around a resize; the bound 1e-5 relative leaves
room for that rounding to grow through a few hundred steps of training, as measured there:
2.5e-5 absolute over 200 steps at loss ~5)."""

from __future__ import annotations

from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import elastron_train
from tests.workers.service_on_ray import JobView, PlacementSampler, service_on_ray

ITERS = 400  # the elastic job's; the urgent one trains 10
LOSS_BOUND = 1e-5  # relative, every step (see the module docstring)


def _print_timeline(jobs: JobView, job_id: str) -> None:
    keep = ("replica", "replicas", "from_replicas", "to_replicas", "seconds", "message", "cause", "iteration")
    for e in jobs.events(job_id):
        if e["kind"] != "checkpoint_saved":
            data = e.get("data") or {}
            print(e["time"], e["kind"], {k: str(data[k])[:160] for k in keep if k in data})


def _spec(name: str, iters: int = ITERS, **sections) -> dict:
    sections = {"checkpoint": {"interval": 100}, **sections}
    return job(name=name, training={"train_iters": iters, "log_interval": 50}, **sections)


LIVE = {
    "on_rank_failure": "replace_replica",
    "lost_replica_share": "redistribute",
    "resize": "live",
    "max_restarts": 2,
}


def test_a_live_job_releases_a_replica_for_an_urgent_job_on_ray(ray_cluster, tmp_path):
    """Over 30 s: the elastic job's launch and 400 steps, the urgent job's launch, and the
    uninterrupted reference run."""
    with (
        service_on_ray(ray_cluster, tmp_path, scheduler_grow_after_s=0.0) as service,
        service.client() as api,
        PlacementSampler() as sampler,
    ):
        jobs = JobView(api)
        flex = jobs.submit(_spec("flex", resources={"ranks": 2, "min_ranks": 1}, resilience=LIVE))["id"]
        wait_for(lambda: (jobs.get(flex)["iteration"] or 0) >= 20, 240, "the elastic job stepping")
        urgent = jobs.submit(_spec("urgent", 10, resources={"ranks": 1}, scheduling={"priority": 10}))["id"]
        shrink = wait_for(lambda: jobs.events(flex, "resized"), 120, "the elastic job released a replica")[0]
        assert jobs.state(urgent, "succeeded", timeout=240)["iteration"] == 10
        done = jobs.state(flex, "succeeded", "failed", timeout=300)
        assert done["state"] == "succeeded", done["failure_cause"]
        assert done["attempt"] == 1  # one launch: no stop, no relaunch
        _print_timeline(jobs, flex)
        assert shrink["data"]["live"] is True
        assert (shrink["data"]["from_replicas"], shrink["data"]["to_replicas"]) == (2, 1)
        assert not jobs.events(flex, "preempting") and not jobs.events(flex, "preempted")
        assert not jobs.events(flex, "checkpoint_saved") or all(
            e["iteration"] % 100 == 0 for e in jobs.events(flex, "checkpoint_saved")
        )  # only its own interval's saves: a resize saves nothing
        started = jobs.events(flex, "replica_started")
        zero = [e for e in started if e["data"]["replica"] == 0]
        ones = [e for e in started if e["data"]["replica"] == 1]
        assert len(zero) == 1, zero  # replica 0 was never restarted: one process throughout
        assert len(ones) == 1, ones  # replica 1 at the start, released, not restarted
        assert any(e["data"].get("replica") == 1 for e in jobs.events(flex, "replica_left"))
        records = jobs.get(flex, f"/metrics?limit={ITERS + 10}")["records"]
    placed = sampler.check(cpus=2.0)
    reference = elastron_train(
        _spec("flex", resources={"ranks": 2}, checkpoint={"interval": 100, "path": str(tmp_path / "ref" / "ckpt")}),
        tmp_path / "ref",
    )
    got = {r["iteration"]: r for r in records}
    assert list(got) == list(range(1, ITERS + 1))  # every step once: none lost, none redone
    want = {r["iteration"]: r["loss"] for r in reference}
    assert {r["replicas"] for r in records} == {1, 2}  # it did train alone for a while
    worst = max(abs(got[i]["loss"] - want[i]) / want[i] for i in got)
    assert worst <= LOSS_BOUND, worst
    assert sum(r["tokens"] for r in records) == sum(r["tokens"] for r in reference)  # consumed samples
    print(
        f"live 2->1 in {shrink['data']['seconds']} s; "
        f"{sum(r['replicas'] == 1 for r in records)} steps alone; max rel |loss - uninterrupted| {worst:.2e}; {placed}"
    )
