"""Preemption on a real Ray cluster, through the service: the API (its reconciler and scheduler,
RayJobsLauncher on the shared two-node test cluster) runs a low-priority job; an urgent job that
needs the whole cluster arrives; the low job hears it in its telemetry answers, saves a
checkpoint of the step it is at (none was due) and stops, goes back to the queue, and once the
urgent one has finished it is launched again, resumes from exactly that step (nothing lost)
and ends with the losses of an uninterrupted run, bitwise.
About 70 s on a 2-core machine beyond the shared cluster's start."""

from __future__ import annotations

import sys

import httpx

from engine.launcher import free_port
from service.launcher import RayJobsLauncher
from tests.service.conftest import ApiServer, make_settings, make_tokens
from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import elastron_train

ITERS = 120  # the low job's; the urgent one trains 10


def _spec(name: str, iters: int = ITERS, **sections) -> dict:
    sections = {"checkpoint": {"interval": 4}, **sections}
    return job(name=name, training={"train_iters": iters, "log_interval": 10}, **sections)


def test_a_preempted_job_is_requeued_and_resumes_to_the_uninterrupted_losses(ray_cluster, tmp_path):
    port = free_port()
    entrypoint = f"{sys.executable} -m elastron.cli worker-run {{job_id}} --storage {tmp_path / 'runs'}"
    settings = make_settings(
        tmp_path / "home", None, port, ray_address=f"http://{ray_cluster.webui_url}", ray_timeout_s=30.0,
        reconcile_interval_s=0.5, worker_entrypoint=entrypoint, preempt_grace_s=120.0,
    )  # fmt: skip
    tokens = make_tokens(settings)
    launcher = RayJobsLauncher(settings.ray_address, entrypoint=entrypoint, timeout_s=30.0)
    server = ApiServer(settings, launcher, port).start()
    headers = {"Authorization": f"Bearer {tokens['alice']}"}
    api = httpx.Client(base_url=server.url, headers=headers, timeout=30)

    def get(job_id: str, what: str = "") -> dict:
        return api.get(f"/v1/jobs/{job_id}{what}").json()

    def state(job_id: str, *states: str, timeout: float = 180) -> dict:
        return wait_for(lambda: (j := get(job_id))["state"] in states and j, timeout, f"{job_id} {states}")

    try:
        low = api.post("/v1/jobs", json=_spec("low")).json()["id"]
        wait_for(lambda: (get(low)["iteration"] or 0) >= 9, 240, "the low job past its second checkpoint")
        urgent = api.post("/v1/jobs", json=_spec("urgent", 10, scheduling={"priority": 10})).json()
        assert urgent["state"] == "queued", urgent
        state(low, "queued")  # preempted: stopped, back in the queue
        kinds = [e["kind"] for e in get(low, "/events?limit=500")["events"]]
        assert "preempting" in kinds and "preempted" in kinds
        assert state(urgent["id"], "succeeded", timeout=240)["iteration"] == 10
        done = state(low, "succeeded", "failed", timeout=300)
        assert done["state"] == "succeeded", done["failure_cause"]
        assert done["attempt"] == 2
        events = get(low, "/events?limit=500")["events"]
        (preempted,) = [e for e in events if e["kind"] == "preempted"]
        resumed_at, stopped_at = preempted["data"]["resume_iteration"], preempted["data"]["stopped_at_iteration"]
        assert 8 <= resumed_at == stopped_at < ITERS  # stopped mid-run at a step it saved: none lost
        assert "stop_sent" not in [e["kind"] for e in events]  # it stopped as asked, no signal needed
        assert any(e["kind"] == "stopped_on_request" for e in events)
        records = get(low, f"/metrics?limit={ITERS + 10}")["records"]
    finally:
        api.close()
        server.stop()
    uninterrupted = _spec("low", checkpoint={"interval": 4, "path": str(tmp_path / "reference" / "ckpt")})
    reference = elastron_train(uninterrupted, tmp_path / "reference")
    got = {r["iteration"]: r["loss"] for r in records}
    assert list(got) == list(range(1, ITERS + 1))
    want = {r["iteration"]: r["loss"] for r in reference}
    assert got == want  # bitwise: the same layout on CPU, resumed from a checkpoint
    print(f"final loss {got[ITERS]!r} (uninterrupted {want[ITERS]!r}); stopped at {stopped_at}, resumed at {resumed_at}")
