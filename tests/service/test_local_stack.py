"""The real thing, minus the engine: `elastron up` starts a local Ray head and the API (uvicorn
--factory service.app:create_app), jobs go through RayJobsLauncher to Ray Jobs and back over
telemetry, the CLI drives it, `elastron down` stops it.

The Ray jobs run tests/service/fake_worker.py (ELASTRON_WORKER_ENTRYPOINT) instead of
`elastron worker-run`, which the workers package provides. One Ray head for the module: it is
the slow part (~15 s here).
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.launcher import LaunchStatus, RayJobsLauncher
from tests.environ import environment
from tests.service.launchers import HERE
from tests.waiting import wait_for

ELASTRON = [sys.executable, "-m", "elastron.cli"]


@dataclass
class Stack:
    home: Path
    env: dict[str, str]
    api_url: str
    ray_address: str
    token: str

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*ELASTRON, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=Path(__file__).resolve().parents[2],
        )

    def job(self, job_id: str) -> dict:
        return httpx.get(
            f"{self.api_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {self.token}"}
        ).json()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("stack")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTRON_")}
    env.update(
        ELASTRON_HOME=str(home),
        HOME=str(home),  # a fresh user: no ~/.ray/auth_token; `up` brings the Ray head's token
        ELASTRON_WORKER_ENTRYPOINT=f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'fake_worker.py'))}",
        ELASTRON_RECONCILE_INTERVAL_S="0.5",
        # Inherited by the Ray head, so by its jobs: each job waits after 2 iterations for its gate file.
        FAKE_WORKER_GATE=str(home / "gate-{job_id}"),
        FAKE_WORKER_PAUSE_AT="2",
    )
    cwd = Path(__file__).resolve().parents[2]
    # `up` as a background shell starts it (nohup, `&` in a script, CI): SIGINT ignored, which
    # its Ray head inherits; `down` must still stop the head by its signal, not by the kill after
    # its 60 s wait (issue 52: every CI run's two stack teardowns sat out that wait).
    in_background = ["bash", "-c", 'trap "" INT; exec "$@"', "up"]
    up = subprocess.run(
        [*in_background, *ELASTRON, "up"], env=env, capture_output=True, text=True, timeout=300, cwd=cwd
    )
    pids = [int((home / f).read_text()) for f in ("api.pid", "ray.pid") if (home / f).exists()]
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "elastron is up" in up.stdout and str(home / "token") in up.stdout
        api_url = (home / "api_url").read_text().strip()
        assert f"web UI     {api_url}/ui" in up.stdout  # the page is found from the first command
        assert httpx.get(f"{api_url}/ui").status_code == 200
        stack = Stack(
            home,
            env,
            (home / "api_url").read_text().strip(),
            (home / "ray_address").read_text().strip(),
            (home / "token").read_text().strip(),
        )
        yield stack
    finally:
        down = subprocess.run(
            [*ELASTRON, "down"], env=env, capture_output=True, text=True, timeout=180, cwd=cwd
        )
        assert down.returncode == 0, down.stdout + down.stderr
        assert "killed" not in down.stdout, down.stdout
        for pid in pids:
            assert wait_for(lambda pid=pid: not _pid_alive(pid), 60, f"pid {pid} to exit")


def test_up_runs_ray_and_the_api_with_a_private_token(stack):
    assert httpx.get(f"{stack.api_url}/healthz").json() == {"status": "ok"}
    assert wait_for(lambda: httpx.get(f"{stack.api_url}/readyz").status_code == 200, 30, "readyz")
    assert stat.S_IMODE((stack.home / "token").stat().st_mode) == 0o600
    assert stat.S_IMODE((stack.home / "ray_token").stat().st_mode) == 0o600  # not ~/.ray
    assert httpx.get(f"{stack.api_url}/v1/jobs").status_code == 401  # auth is on
    again = stack.cli("up")
    assert again.returncode == 0 and "already up" in again.stdout


@pytest.fixture
def stack_ray_auth(stack):
    """This process as a client of the stack's Ray head: token mode with the head's private token.

    Ray reads the auth mode and token once per process (RayConfig, the token cache), maybe before
    this test (another test, an import): they are re-read after the variables are set and again
    after they are restored, so neither this test nor a later Ray cluster in this process (tests/
    workers) sees a stale mode."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    with environment(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(stack.home / "ray_token")):
        reset_auth_token_state()
        try:
            yield
        finally:
            reset_auth_token_state()  # once the block has put the variables back


def test_ray_jobs_launcher_against_real_ray(stack, stack_ray_auth):
    """Submit a trivial Ray job with RayJobsLauncher and watch it finish; logs, missing ids, an
    unreachable address. (Its graceful stop is test_cli_cancel_stops_a_ray_job_gracefully.)"""
    script = "import os, sys; print('hello from', os.environ['ELASTRON_JOB_ID'], os.environ['GREETING']); sys.exit(0)"
    launcher = RayJobsLauncher(
        stack.ray_address, entrypoint=f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}", timeout_s=30
    )
    assert launcher.reachable()
    sid = f"launcher-test-{time.monotonic_ns()}"
    env = {"ELASTRON_JOB_ID": "job-1", "GREETING": "hi"}
    assert launcher.submit("job-1", "{}", env, submission_id=sid) == sid
    assert launcher.submit("job-1", "{}", env, submission_id=sid) == sid  # idempotent
    wait_for(lambda: launcher.status(sid) == LaunchStatus.SUCCEEDED, 120, "the Ray job to succeed")
    assert "hello from job-1 hi" in launcher.logs(sid)
    assert launcher.status("no-such-submission") == LaunchStatus.MISSING
    assert launcher.statuses([sid, "no-such-submission"]) == {
        sid: LaunchStatus.SUCCEEDED,
        "no-such-submission": LaunchStatus.MISSING,
    }

    # Any command (a checkpoint export): argv is quoted into Ray's command line; idempotent too.
    cmd = f"{sid}-cmd"
    argv = [sys.executable, "-c", "import os, sys; print('argv', sys.argv[1:], os.environ['GREETING'])", "a b", "--"]
    assert launcher.submit_command(cmd, argv, {"GREETING": "hi"}) == cmd
    assert launcher.submit_command(cmd, argv, {"GREETING": "hi"}) == cmd
    wait_for(lambda: launcher.status(cmd) == LaunchStatus.SUCCEEDED, 120, "the command to succeed")
    assert "argv ['a b', '--'] hi" in launcher.logs(cmd)

    unreachable = RayJobsLauncher("http://127.0.0.1:9", timeout_s=1)
    assert not unreachable.reachable()


def test_cli_submit_follow_status_logs_jobs_on_ray(stack, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: stack-job\ntraining:\n  train_iters: 5\n  global_batch_size: 2\n")
    r = stack.cli("submit", str(job_file))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    (stack.home / f"gate-{job_id}").touch()
    r = stack.cli("logs", job_id, "-f", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5/5" in r.stdout and "iteration 5 loss" in r.stdout  # progress bar and the driver's log
    job = stack.job(job_id)
    assert job["state"] == "succeeded" and job["iteration"] == 5
    assert job["latest_checkpoint"]["uri"].startswith(str(stack.home / "checkpoints" / "local" / job_id))
    status = stack.cli("status", job_id)
    assert "succeeded" in status.stdout and "5/5 iterations" in status.stdout
    assert "iteration 3 loss" in stack.cli("logs", job_id).stdout
    assert job_id in stack.cli("jobs").stdout


def test_cli_cancel_stops_a_ray_job_gracefully(stack, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: to-cancel\ntraining:\n  train_iters: 50\n  global_batch_size: 2\n")
    job_id = stack.cli("submit", str(job_file)).stdout.strip()
    wait_for(lambda: stack.job(job_id)["iteration"] == 2, 120, "two iterations")  # then it waits at its gate
    r = stack.cli("cancel", job_id, "--wait")
    assert r.returncode == 0 and f"{job_id}: cancelled" in r.stdout, r.stdout + r.stderr
    job = stack.job(job_id)
    assert job["state"] == "cancelled" and job["iteration"] == 2
