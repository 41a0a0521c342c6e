"""Preemption on a real Ray cluster, through the service: the API (its reconciler and scheduler,
RayJobsLauncher on the shared two-node test cluster) runs a low-priority job; an urgent job that
needs the whole cluster arrives; the low job hears it in its telemetry answers, saves a
checkpoint of the step it is at (none was due) and stops, goes back to the queue, and once the
urgent one has finished it is launched again, resumes from exactly that step (nothing lost)
and ends with the losses of an uninterrupted run, bitwise. The API is restarted while the
preempted job waits and the urgent one runs: neither is lost.
About 70 s on a 2-core machine beyond the shared cluster's start."""

from __future__ import annotations

from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import elastron_train
from tests.workers.service_on_ray import JobView, PlacementSampler, service_on_ray

ITERS = 120  # the low job's
URGENT_ITERS = 30


def _spec(name: str, iters: int = ITERS, **sections) -> dict:
    sections = {"checkpoint": {"interval": 4}, **sections}
    return job(name=name, training={"train_iters": iters, "log_interval": 10}, **sections)


def test_a_preempted_job_is_requeued_and_resumes_to_the_uninterrupted_losses(ray_cluster, tmp_path):
    """Over 30 s: two launches of the low job and one of the urgent job through the service, an API
    restart between them, and the uninterrupted reference run."""
    with service_on_ray(ray_cluster, tmp_path) as service, service.client() as api, PlacementSampler() as sampler:
        jobs = JobView(api)
        low = jobs.submit(_spec("low"))["id"]
        wait_for(lambda: (jobs.get(low)["iteration"] or 0) >= 9, 240, "the low job past its second checkpoint")
        urgent = jobs.submit(_spec("urgent", URGENT_ITERS, scheduling={"priority": 10}))
        assert urgent["state"] == "queued", urgent
        jobs.state(low, "queued")  # preempted: stopped, back in the queue
        assert jobs.events(low, "preempting") and jobs.events(low, "preempted")
        # An API restart with one job preempted and queued and one running loses neither.
        service.restart()
        assert jobs.get(low)["state"] in ("queued", "starting", "running")
        assert jobs.get(urgent["id"])["state"] in ("starting", "running", "succeeded")
        assert jobs.state(urgent["id"], "succeeded", timeout=240)["iteration"] == URGENT_ITERS
        done = jobs.state(low, "succeeded", "failed", timeout=300)
        assert done["state"] == "succeeded", done["failure_cause"]
        assert done["attempt"] == 2
        (preempted,) = jobs.events(low, "preempted")
        resumed_at, stopped_at = preempted["data"]["resume_iteration"], preempted["data"]["stopped_at_iteration"]
        assert 8 <= resumed_at == stopped_at < ITERS  # stopped mid-run at a step it saved: none lost
        assert not jobs.events(low, "stop_sent")  # it stopped as asked, no signal needed
        assert jobs.events(low, "stopped_on_request")
        # both launches pinned rank by rank where the scheduler admitted them
        pinned = [e["data"]["placement"] for e in jobs.events(low, "placement_scheduled")]
        assert len(pinned) == 2 and all(sum(p.values()) == 2 for p in pinned), pinned
        records = jobs.get(low, f"/metrics?limit={ITERS + 10}")["records"]
    placed = sampler.check(cpus=2.0)
    uninterrupted = _spec("low", checkpoint={"interval": 4, "path": str(tmp_path / "reference" / "ckpt")})
    reference = elastron_train(uninterrupted, tmp_path / "reference")
    got = {r["iteration"]: r["loss"] for r in records}
    assert list(got) == list(range(1, ITERS + 1))
    want = {r["iteration"]: r["loss"] for r in reference}
    assert got == want  # bitwise: the same layout on CPU, resumed from a checkpoint
    print(f"final loss {got[ITERS]!r} (uninterrupted {want[ITERS]!r}); stopped at {stopped_at}, resumed at {resumed_at}; {placed}")
