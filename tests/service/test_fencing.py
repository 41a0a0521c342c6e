"""Issue 61, fencing: an attempt the control plane gave up on (a Ray submission that timed out
and landed late, a Ray job that vanished with its head node) can neither report nor save, and
is stopped on Ray; a vanished attempt is queued again under the job's budget, not failed."""

from __future__ import annotations

import httpx

from engine.jobspec import contract
from service.launcher import LauncherUnavailable, LaunchStatus
from tests.service.launchers import FakeLauncher
from tests.service.test_api_jobs import TINY
from tests.waiting import wait_for
from workers.fencing import commit_guard
from workers.telemetry import TelemetrySender, fenced_answer, telemetry_url


class LateLauncher(FakeLauncher):
    """Its first submission times out (LauncherUnavailable) and shows up on Ray only when the
    test says so (`land`): Ray Jobs answering after the client gave up."""

    def __init__(self) -> None:
        super().__init__()
        self.late: dict[str, dict] = {}

    def submit(self, job_id, spec_json, env, *, submission_id=None):
        if not self.late:
            self.late[submission_id] = {"job_id": job_id, "env": dict(env), "status": LaunchStatus.RUNNING}
            raise LauncherUnavailable("fake Ray did not answer in time")
        return super().submit(job_id, spec_json, env, submission_id=submission_id)

    def land(self) -> str:
        (sid,) = self.late
        self.submissions[sid] = self.late[sid]
        return sid


def _events(env, job_id: str, kind: str) -> list[dict]:
    with env.client("admin") as c:
        return c.get(f"/v1/jobs/{job_id}/events", params={"kind": kind}).json()["events"]


def _post(env, job_id: str, token: str, fence: int | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"}
    if fence is not None:
        headers[contract.FENCING_HEADER] = str(fence)
    return httpx.post(
        env.server.url + contract.TELEMETRY_PATH.format(job_id=job_id),
        json={"records": [], "events": [{"ts": 1.0, "kind": "orphan_says_hi", "source": "rank-0"}]},
        headers=headers,
        timeout=10,
    )


def _rank0_sender(env, job_id: str, launch_env: dict, fencing_token: int, spool: str = "spool", **kw):
    """Rank 0's telemetry client of the attempt launched with `launch_env`."""
    return TelemetrySender(
        telemetry_url(env.server.url, job_id),
        job_id,
        "rank-0",
        token=launch_env[contract.ENV_API_TOKEN],
        fencing_token=fencing_token,
        spool_dir=env.settings.home / spool,
        **kw,
    )


def test_a_late_landing_submission_is_fenced_refused_and_stopped(start_env):
    launcher = LateLauncher()
    env = start_env(launcher, ray_timeout_s=0.2)
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
    relaunched = wait_for(
        lambda: (j := env.job(job_id, "admin"))["attempt"] == 2 and j["state"] == "starting" and j,
        30,
        "the lost launch to be launched again",
    )
    current_env = launcher.env_of(job_id)
    orphan_sid = launcher.land()  # attempt 1 arrives on Ray after all
    orphan_env = launcher.late[orphan_sid]["env"]
    assert relaunched["submission_id"] != orphan_sid
    assert (orphan_env[contract.ENV_FENCING_TOKEN], current_env[contract.ENV_FENCING_TOKEN]) == ("1", "2")

    # The reconciler sees the orphan on Ray and stops it, with an event on the job.
    wait_for(lambda: orphan_sid in launcher.stopped, 30, "the orphan submission to be stopped")
    (stopped,) = wait_for(lambda: _events(env, job_id, "orphan_stopped"), 30, "the orphan_stopped event")
    assert stopped["data"]["submission_id"] == orphan_sid and stopped["data"]["fencing_token"] == 1

    # Its telemetry is refused with a distinct code, not the 401 of an unknown token.
    refused = _post(env, job_id, orphan_env[contract.ENV_API_TOKEN], fence=1)
    assert refused.status_code == 409, refused.text
    (detail,) = refused.json()["detail"]
    assert detail["type"] == contract.FENCED_CODE and detail["current_fencing_token"] == 2
    assert _post(env, job_id, "job_" + "x" * 43).status_code == 401
    # The current attempt reports; with a wrong fencing token it is refused too.
    assert _post(env, job_id, current_env[contract.ENV_API_TOKEN], fence=2).status_code == 200
    assert _post(env, job_id, current_env[contract.ENV_API_TOKEN], fence=1).status_code == 409
    assert not [e for e in _events(env, job_id, "orphan_says_hi") if e["data"].get("fencing_token") == 1]

    # The orphan's own telemetry client obeys: it stops sending and calls its owner's exit.
    told: list[str] = []
    orphan = _rank0_sender(env, job_id, orphan_env, 1, on_fenced=told.append)
    orphan.record({"iteration": 1, "loss": 1.0, "attempt": 0, "group": 0})
    orphan.flush(10)
    assert orphan.fenced.is_set() and len(told) == 1 and "fencing token 1" in told[0]
    assert not orphan.spool_path.exists() and orphan.delivered_batches == 0
    orphan.record({"iteration": 2, "loss": 1.0, "attempt": 0, "group": 0})  # ignored from now on
    assert orphan.flush(1)

    # ... and rank 0 of the orphan never commits a checkpoint: the guard before the commit exits.
    exits: list[str] = []
    current = _rank0_sender(env, job_id, current_env, 2)
    commit_guard(current, exit=exits.append)(10)
    assert exits == []  # the current attempt commits
    fresh_orphan = _rank0_sender(env, job_id, orphan_env, 1, "spool2")
    commit_guard(fresh_orphan, exit=exits.append)(10)  # has sent nothing since it was fenced
    assert len(exits) == 1 and "iteration 10 is not committed" in exits[0]


def test_a_vanished_running_job_is_queued_again_with_a_new_attempt(start_env):
    """A head node lost with its job table: the job's Ray job is gone. It is queued again (new
    attempt, new fencing token) while its budget lasts, then failed."""
    fake = FakeLauncher()
    env = start_env(fake, lost_job_requeues=1)
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
    first = env.wait_state(job_id, "starting")["submission_id"]
    fake.set_status(first, LaunchStatus.RUNNING)
    old_token = fake.env_of(job_id)[contract.ENV_API_TOKEN]
    del fake.submissions[first]  # the head OOMs: every Ray job's record is gone

    second = wait_for(
        lambda: (j := env.job(job_id, "admin"))["attempt"] == 2 and j["state"] == "starting" and j,
        30,
        "the vanished job to be launched again",
    )
    assert second["submission_id"] != first
    assert fake.env_of(job_id)[contract.ENV_FENCING_TOKEN] == "2"
    (lost,) = _events(env, job_id, "attempt_lost")
    assert lost["data"]["submission_id"] == first and lost["data"]["budget"] == 1
    assert _post(env, job_id, old_token).status_code == 409  # the lost attempt is fenced

    del fake.submissions[second["submission_id"]]  # lost again: the budget (1) is spent
    failed = env.wait_state(job_id, "failed")
    assert "vanished" in failed["failure_cause"] and "budget of 1" in failed["failure_cause"]


def test_the_fenced_answer_is_told_from_other_refusals():
    body = b'{"detail": [{"type": "attempt_fenced", "msg": "stop"}]}'
    assert fenced_answer(409, body) == "stop"
    assert fenced_answer(401, body) is None
    assert fenced_answer(409, b'{"detail": "conflict"}') is None
    assert fenced_answer(409, b"not json") is None


def test_the_lost_budget_is_the_larger_of_the_setting_and_the_jobs_max_restarts():
    from service.fencing import lost_budget
    from service.settings import Settings
    from service.store.models import Job

    settings = Settings(lost_job_requeues=3)
    assert lost_budget(Job(spec={"resilience": {"max_restarts": 5}}), settings) == 5
    assert lost_budget(Job(spec={"resilience": {"max_restarts": 1}}), settings) == 3
    assert lost_budget(Job(spec={}), Settings(lost_job_requeues=0)) == 0


def test_a_job_whose_driver_was_killed_is_queued_again(start_env):
    """The driver's process was OOM-killed with the head (no verdict of its own): requeued; a
    driver that failed by itself (exit 1) still fails the job."""
    fake = FakeLauncher()
    env = start_env(fake)
    with env.client() as c:
        lost_id = c.post("/v1/jobs", json={**TINY, "name": "lost"}).json()["id"]
        failed_id = c.post("/v1/jobs", json={**TINY, "name": "failed"}).json()["id"]
    lost_sid = env.wait_state(lost_id, "starting")["submission_id"]
    failed_sid = env.wait_state(failed_id, "starting")["submission_id"]
    fake.set_status(lost_sid, LaunchStatus.FAILED, "Job entrypoint command failed with exit code -9")
    fake.set_status(failed_sid, LaunchStatus.FAILED, "Job entrypoint command failed with exit code 1")
    wait_for(lambda: env.job(lost_id, "admin")["attempt"] == 2, 30, "the job to be launched again")
    (lost,) = _events(env, lost_id, "attempt_lost")
    assert "lost its driver" in lost["message"] and "exit code -9" in lost["message"]
    assert "exit code 1" in env.wait_state(failed_id, "failed")["failure_cause"]
