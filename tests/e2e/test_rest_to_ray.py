"""End to end, nothing faked: `elastron up` (a local Ray head and the API), a job submitted over
REST, trained by `elastron worker-run` on 2 Ray ranks with the engine, checkpointed, reported
over telemetry, `succeeded`, and its series on /metrics under its job label; `elastron down`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.tiny_jobs import TINY_LLAMA
from tests.waiting import wait_for

ELASTRON = [sys.executable, "-m", "elastron.cli"]
ROOT = Path(__file__).resolve().parents[2]
JOB = {
    "name": "e2e",
    "model": dict(TINY_LLAMA),
    "training": {"global_batch_size": 4, "micro_batch_size": 2, "train_iters": 4, "log_interval": 2},
    "resources": {"ranks": 2, "device": "cpu"},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("e2e")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTRON_")}
    # HOME too: a fresh user, without a ~/.ray/auth_token (`up` gives its Ray head a token).
    env.update(ELASTRON_HOME=str(home), HOME=str(home), ELASTRON_RECONCILE_INTERVAL_S="0.5")
    run = lambda *args: subprocess.run(  # noqa: E731
        [*ELASTRON, *args], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    up = run("up")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield (home / "api_url").read_text().strip(), (home / "token").read_text().strip(), home
    finally:
        down = run("down")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "killed" not in down.stdout, down.stdout  # stopped by its signal, not after a wait


def test_job_over_rest_trains_on_ray_checkpoints_and_shows_on_metrics(stack):
    """Over 30 s: `elastron up` starts its own Ray head and API as a user's machine would (this module
    owns that cluster, not the suite's shared one), and one 2-rank job runs on it."""
    api, token, home = stack
    auth = {"Authorization": f"Bearer {token}"}
    job = {**JOB, "checkpoint": {"path": str(home / "ckpt"), "interval": 2}}
    created = httpx.post(f"{api}/v1/jobs", json=job, headers=auth, timeout=30)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]

    def final_state():
        state = httpx.get(f"{api}/v1/jobs/{job_id}", headers=auth, timeout=30).json()["state"]
        return state if state in ("succeeded", "failed", "cancelled") else None

    assert wait_for(final_state, 400, "the job to finish") == "succeeded"
    job = httpx.get(f"{api}/v1/jobs/{job_id}", headers=auth, timeout=30).json()
    assert job["iteration"] == 4 and job["latest_checkpoint"]["iteration"] == 4, job

    records = httpx.get(f"{api}/v1/jobs/{job_id}/metrics", headers=auth, timeout=30).json()["records"]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    saves = httpx.get(f"{api}/v1/jobs/{job_id}/checkpoints", headers=auth, timeout=30).json()["checkpoints"]
    assert sorted(c["iteration"] for c in saves if c["result"] == "success") == [2, 4]

    # The job's log (Ray Jobs, through the API) has rank 0's progress line once per log interval.
    log = httpx.get(f"{api}/v1/jobs/{job_id}/logs", headers=auth, timeout=30).text
    assert [line.count("iter     2/4 | loss") for line in log.splitlines() if "iter     2/4" in line] == [
        1
    ], log

    scrape = httpx.get(f"{api}/metrics", headers=auth, timeout=30).text
    series = [
        line
        for line in scrape.splitlines()
        if line.startswith("elastron_job_iteration{") and f'job="{job_id}"' in line
    ]
    assert series and series[0].rsplit(" ", 1)[1] in ("4", "4.0"), series
