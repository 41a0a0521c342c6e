"""Restarting the API loses nothing: jobs run on outside the API (ProcessLauncher: detached
processes, like Ray jobs), and a new API instance over the same store reconciles each non-final
job with the launcher and records what it found."""

from __future__ import annotations

import pytest

from service.launcher import LaunchStatus
from service.store.db import in_transaction
from service.store.jobs import get_job
from tests.service.conftest import ApiServer
from tests.service.launchers import FakeLauncher, ProcessLauncher
from tests.service.test_api_jobs import TINY
from tests.waiting import wait_for


@pytest.fixture
def processes(tmp_path):
    launcher = ProcessLauncher(
        tmp_path / "launches",
        extra_env={"FAKE_WORKER_GATE": str(tmp_path / "gate"), "FAKE_WORKER_PAUSE_AT": "3"},
    )
    yield launcher
    launcher.kill_all()


def test_api_restart_mid_job_keeps_the_job_and_reports_it(start_env, processes, tmp_path):
    env = start_env(processes)
    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "training": {"train_iters": 8}}).json()["id"]
    wait_for(lambda: env.job(job_id)["iteration"] == 3, what="the worker's first 3 iterations")
    assert env.job(job_id)["state"] == "running"

    env.server.stop()  # the API goes away; the worker keeps running
    (tmp_path / "gate").touch()  # ... and trains on, resending its records until an API answers
    restarted = ApiServer(env.settings, ProcessLauncher(processes.state_dir), env.server.port).start()
    env.server = restarted
    try:
        done = env.wait_state(job_id, "succeeded")
        assert done["iteration"] == 8 and done["attempt"] == 1  # the same launch, not a relaunch
        assert done["latest_checkpoint"]["uri"].endswith("/tiny/iter_0000008")
        with env.client() as c:
            events = c.get(f"/v1/jobs/{job_id}/events").json()["events"]
            records = c.get(f"/v1/jobs/{job_id}/metrics").json()["records"]
        (found,) = [e for e in events if e["kind"] == "reconciled"]
        assert found["data"]["launcher_status"] == "running" and "API start" in found["message"]
        assert [r["iteration"] for r in records] == list(range(1, 9))
        assert "iteration 8" in processes.logs(done["submission_id"])
    finally:
        restarted.stop()


def test_jobs_that_ended_or_vanished_while_the_api_was_away(start_env):
    fake = FakeLauncher()
    # No requeue budget: a vanished job fails (tests/service/test_fencing.py: it is requeued).
    env = start_env(fake, lost_job_requeues=0)
    with env.client() as c:
        ids = [c.post("/v1/jobs", json={**TINY, "name": f"j{i}"}).json()["id"] for i in range(4)]
    sids = [env.wait_state(i, "starting")["submission_id"] for i in ids]
    env.server.stop()
    fake.set_status(sids[0], LaunchStatus.SUCCEEDED)
    fake.set_status(sids[1], LaunchStatus.FAILED, "Job entrypoint command failed with exit code 1")
    del fake.submissions[sids[2]]  # vanished (the Ray cluster was replaced)
    fake.set_status(sids[3], LaunchStatus.RUNNING)
    env.server = ApiServer(env.settings, fake, env.server.port).start()
    try:
        assert env.wait_state(ids[0], "succeeded")
        assert "exit code 1" in env.wait_state(ids[1], "failed")["failure_cause"]
        assert "vanished" in env.wait_state(ids[2], "failed")["failure_cause"]
        wait_for(lambda: env.server.ctx.reconciler.reconciled_on_start, what="the start-up reconcile")
        assert env.job(ids[3])["state"] == "starting"
        with env.client("admin") as c:
            for job_id, status in zip(ids, ("succeeded", "failed", "missing", "running"), strict=True):
                (found,) = c.get(f"/v1/jobs/{job_id}/events", params={"kind": "reconciled"}).json()["events"]
                assert found["data"]["launcher_status"] == status
    finally:
        env.server.stop()


def test_a_launch_interrupted_before_reaching_ray_is_launched_again(start_env):
    """The API wrote its launch intent (submission id, token) and stopped before Ray got it."""
    fake = FakeLauncher()
    fake.up = False
    env = start_env(fake, reconcile=False)
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
    ctx = env.server.ctx

    def write_intent(s):
        job = get_job(s, job_id)
        job.attempt, job.submission_id, job.launched_at = 1, f"elastron-{job_id}-1", 0.0

    in_transaction(ctx.sessions, write_intent)
    env.server.stop()
    fake.up = True
    env.server = ApiServer(env.settings, fake, env.server.port).start()
    try:
        started = env.wait_state(job_id, "starting")
        assert started["submission_id"] == f"elastron-{job_id}-2" and started["attempt"] == 2
        assert list(fake.submissions) == [f"elastron-{job_id}-2"]
        with env.client() as c:
            kinds = [e["kind"] for e in c.get(f"/v1/jobs/{job_id}/events").json()["events"]]
        assert kinds.index("launch_lost") < kinds.index("launch")
    finally:
        env.server.stop()


def test_a_launch_that_reached_ray_is_adopted_not_repeated(start_env):
    fake = FakeLauncher()
    env = start_env(fake, reconcile=False)
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
    sid = f"elastron-{job_id}-1"

    def write_intent(s):
        job = get_job(s, job_id)
        job.attempt, job.submission_id, job.launched_at = 1, sid, 0.0

    in_transaction(env.server.ctx.sessions, write_intent)
    fake.submit(job_id, "{}", {}, submission_id=sid)  # it got through just before the API stopped
    fake.set_status(sid, LaunchStatus.RUNNING)
    env.server.stop()
    env.server = ApiServer(env.settings, fake, env.server.port).start()
    try:
        assert env.wait_state(job_id, "starting")["attempt"] == 1
        assert list(fake.submissions) == [sid]
    finally:
        env.server.stop()


def test_cancel_stops_a_running_process_gracefully(start_env, processes, tmp_path):
    env = start_env(processes)
    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "training": {"train_iters": 8}}).json()["id"]
        wait_for(lambda: env.job(job_id)["iteration"] == 3, what="3 iterations")
        assert c.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    done = env.wait_state(job_id, "cancelled")
    assert done["iteration"] == 3
    assert (processes.state_dir / done["submission_id"] / "rc").read_text() == "130"  # SIGINT path
