"""`resilience.resize: live` on a real Ray cluster, through the service: the API (its reconciler and
scheduler, RayJobsLauncher on the shared two-node test cluster of two 1-CPU nodes) runs an elastic
replace_replica job on 2 one-rank replica groups; an urgent 1-rank job arrives; the scheduler asks
the elastic job for one replica group (TelemetryAck.replicas); its driver releases replica 1 at a
step boundary, whose Ray Train run ends and frees its CPU, and replica 0 trains on alone, taking
replica 1's share of each global batch (`lost_replica_share: redistribute`); the urgent job runs in
the freed room; once it has ended the scheduler grows the job back to 2: a new replica group, in a
process started ahead (resilience.warm_restart, on by default for a live job), heals from replica 0
and joins. No checkpoint, stop or new attempt: replica 0's process is the same from the first step
to the last.

The job is long (train_iters 20000, its learning-rate schedule fixed by lr_decay_iters) and
cancelled once it has trained a while at 2 replicas again, so that the test waits on the events
and not on a guess of how long the urgent job and the grow take; the reference then trains exactly
as many steps (the data do not depend on train_iters: engine/data/gpt_dataset.py).

Losses against the uninterrupted 2-rank run (`elastron train`, the same data and seed): every step
trains the same samples with the same math, so each loss equals the reference's up to fp32
rounding of the gradient sums, whose order changes with who takes which microbatch (1e-7 relative
measured in tests/engine/test_replica_quorum.py around a resize; the bound 1e-5 relative leaves
room for that rounding to grow through a few hundred steps of training, as measured there:
2.5e-5 absolute over 200 steps at loss ~5)."""

from __future__ import annotations

import itertools

from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import elastron_train
from tests.workers.service_on_ray import JobView, PlacementSampler, service_on_ray

ITERS = 20000  # planned; the job is cancelled long before (the urgent one trains 10)
AFTER_GROW = 60  # steps trained at 2 replicas again before the cancel
SCHEDULE = {"lr_decay_iters": ITERS}  # the same learning rate at every step in the shorter reference
# A cancel aborts every replica group's run at once (about a second here, ~40 steps): the
# bound says it stopped, where a run that went on until the driver's exit trained thousands more.
STOPPED_WITHIN = 200
LOSS_BOUND = 1e-5  # relative, every step (see the module docstring)


def _print_timeline(jobs: JobView, job_id: str) -> None:
    keep = ("replica", "replicas", "from_replicas", "to_replicas", "seconds", "message", "cause", "iteration")
    for e in jobs.events(job_id):
        if e["kind"] != "checkpoint_saved":
            data = e.get("data") or {}
            print(e["time"], e["kind"], {k: str(data[k])[:160] for k in keep if k in data})


def _spec(name: str, iters: int = ITERS, **sections) -> dict:
    sections = {"checkpoint": {"interval": 1000}, **sections}
    return job(name=name, training={"train_iters": iters, "log_interval": 50}, **sections)


LIVE = {
    "on_rank_failure": "replace_replica",
    "lost_replica_share": "redistribute",
    "resize": "live",
    "max_restarts": 2,
}


def _pids(event: dict) -> dict[int, int]:
    return {r["rank"]: r["pid"] for r in event["data"]["ranks"]}


def test_a_live_job_gives_a_replica_to_an_urgent_job_and_takes_it_back_on_ray(ray_cluster, tmp_path):
    """Over 30 s: the elastic job's launch and its steps through a shrink and a grow, the urgent
    job's launch, and the reference run of as many steps."""
    flex_spec = _spec("flex", resources={"ranks": 2, "min_ranks": 1}, resilience=LIVE, optimizer=SCHEDULE)
    with (
        service_on_ray(ray_cluster, tmp_path, scheduler_grow_after_s=0.0) as service,
        service.client() as api,
        PlacementSampler() as sampler,
    ):
        jobs = JobView(api)
        flex = jobs.submit(flex_spec)["id"]
        wait_for(lambda: (jobs.get(flex)["iteration"] or 0) >= 20, 240, "the elastic job stepping")
        urgent = jobs.submit(_spec("urgent", 10, resources={"ranks": 1}, scheduling={"priority": 10}))["id"]
        shrink = wait_for(lambda: jobs.events(flex, "resized"), 120, "the elastic job released a replica")[0]
        assert jobs.state(urgent, "succeeded", timeout=240)["iteration"] == 10
        grow = wait_for(lambda: jobs.events(flex, "resized")[1:], 120, "the elastic job took its replica back")[0]
        grown_at = jobs.get(flex)["iteration"]
        wait_for(lambda: (jobs.get(flex)["iteration"] or 0) >= grown_at + AFTER_GROW, 120, "steps at 2 again")
        at_cancel = jobs.get(flex)["iteration"]
        assert api.post(f"/v1/jobs/{flex}/cancel").status_code == 202
        done = jobs.state(flex, "cancelled", "succeeded", "failed", timeout=120)
        _print_timeline(jobs, flex)
        assert done["state"] == "cancelled", done["failure_cause"]
        assert done["attempt"] == 1  # one launch: no stop, no relaunch
        for z, sizes in ((shrink, (2, 1)), (grow, (1, 2))):
            assert z["data"]["live"] is True
            assert (z["data"]["from_replicas"], z["data"]["to_replicas"]) == sizes
        assert _pids(grow)[0] == _pids(shrink)[0]  # replica 0's rank: the same process throughout
        assert not jobs.events(flex, "preempting") and not jobs.events(flex, "preempted")
        assert all(e["iteration"] % 1000 == 0 for e in jobs.events(flex, "checkpoint_saved"))  # a resize saves nothing
        started = jobs.events(flex, "replica_started")
        assert [e["data"]["replica"] for e in started if e["data"]["replica"] == 0] == [0]  # never restarted
        assert [e["data"]["replica"] for e in started if e["data"]["replica"] == 1] == [1, 1]  # at the start, at the grow
        assert any(e["data"].get("replica") == 1 for e in jobs.events(flex, "replica_left"))
        records = jobs.get(flex, "/metrics?limit=5000")["records"]
    placed = sampler.check(cpus=2.0)
    got = {r["iteration"]: r for r in records}
    last = max(got)
    assert list(got) == list(range(1, last + 1))  # every step once: none lost, none redone
    before_cancel = [r["replicas"] for r in records if r["iteration"] <= at_cancel]
    assert [k for k, _ in itertools.groupby(before_cancel)] == [2, 1, 2]  # alone, then 2 again
    # (the runs are aborted one after the other: the last steps may be one replica's, with its
    # peer's share, redistribute's; the losses below hold them to the reference too)
    assert grown_at + AFTER_GROW <= last <= at_cancel + STOPPED_WITHIN
    reference = elastron_train(
        {**flex_spec, "resources": {"ranks": 2}, "resilience": {},
         "training": {**flex_spec["training"], "train_iters": last},
         "checkpoint": {"interval": 1000, "path": str(tmp_path / "ref" / "ckpt")}},
        tmp_path / "ref",
    )  # fmt: skip
    want = {r["iteration"]: r["loss"] for r in reference}
    worst = max(abs(got[i]["loss"] - want[i]) / want[i] for i in got)
    assert worst <= LOSS_BOUND, worst
    assert sum(r["tokens"] for r in records) == sum(r["tokens"] for r in reference)  # consumed samples
    print(
        f"live 2->1 in {shrink['data']['seconds']} s, 1->2 in {grow['data']['seconds']} s; "
        f"{sum(r['replicas'] == 1 for r in records)} of {last} steps alone; "
        f"max rel |loss - uninterrupted| {worst:.2e}; {placed}"
    )
