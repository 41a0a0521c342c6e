"""Progress, ETA and time spent restarting (service/progress.py) on the job record, in the list,
in `elastron jobs` and on both pages of the web UI.

The ETA's stated margin: on a job whose steps take a steady time, the ETA read part-way through
is within 25 % (plus one second for the page's refresh) of the time the job really took to finish. It
counts steps only, so what is not a step (here: one HTTP post per record) makes it optimistic.
"""

from __future__ import annotations

import re
import time

import pytest

from service import progress
from tests.service.launchers import ProcessLauncher
from tests.service.test_api_jobs import TINY
from tests.service.test_cli import cli
from tests.service.test_ui import browser, post_records, records, sign_in  # noqa: F401 (fixture)
from tests.waiting import wait_for

ETA_MARGIN = 0.25


def test_fields_from_recent_steps_and_restarts():
    stats: dict = {}
    assert progress.fields("queued", None, 100, stats) == {"progress": None, "eta_s": None, "restart_s": 0.0}
    for s in [9.0] * 30 + [1.0] * progress.STEP_WINDOW:  # the old pace is forgotten
        progress.observe_step(stats, s)
    assert len(stats["recent_steps"]) == progress.STEP_WINDOW
    out = progress.fields("running", 40, 100, stats)
    assert out["progress"] == 0.4 and out["eta_s"] == pytest.approx(60.0)
    assert progress.fields("succeeded", 100, 100, stats)["eta_s"] is None
    progress.on_transition(stats, "running", "restarting", now=1000.0)
    assert progress.fields("restarting", 40, 100, stats, now=1004.0)["restart_s"] == 4.0
    progress.on_transition(stats, "restarting", "running", now=1010.0)
    progress.on_transition(stats, "running", "restarting", now=2000.0)
    progress.on_transition(stats, "restarting", "running", now=2002.5)
    assert progress.fields("running", 40, 100, stats, now=3000.0)["restart_s"] == 12.5


def test_the_api_serves_progress_eta_and_restart_time(env):
    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "training": {"train_iters": 100}}).json()["id"]
    env.wait_state(job_id, "starting")
    post_records(env, job_id, records(25))  # step_time_s 0.2
    job = env.job(job_id)
    assert job["progress"] == 0.25 and job["eta_s"] == pytest.approx(75 * 0.2)
    with env.client() as c:
        listed = c.get("/v1/jobs").json()["jobs"][0]
    assert (listed["progress"], listed["eta_s"]) == (job["progress"], job["eta_s"])
    with env.client("admin") as admin:
        restart = {"kind": "restart", "cause": "node_lost", "ts": time.time(), "iteration": 25}
        admin.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"events": [restart]})
        assert env.job(job_id)["state"] == "restarting"
        time.sleep(0.5)
        post_records(env, job_id, records(5, start=26))
    job = env.job(job_id)
    assert job["state"] == "running" and 0.5 <= job["restart_s"] < 30
    out = cli(env, "jobs").stdout
    assert re.search(rf"{job_id}\s+running\s+30/100\s+30\s+00:00:14", out), out
    assert "ETA 00:00:14" in cli(env, "status", job_id).stdout


def _eta_seconds(text: str) -> float:
    m = re.fullmatch(r"(?:(\d+)h )?(?:(\d+)m )?(\d+)s", text.strip()) or re.fullmatch(r"(\d+)h (\d+)m", text)
    assert m, text
    parts = [int(g or 0) for g in m.groups()]
    return parts[0] * 3600 + parts[1] * 60 + (parts[2] if len(parts) > 2 else 0)


def test_the_eta_on_the_page_is_close_to_the_real_remaining_time(start_env, tmp_path, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    step_s, iters = 0.4, 35
    launcher = ProcessLauncher(tmp_path / "launches", extra_env={"FAKE_WORKER_STEP_S": str(step_s)})
    env = start_env(launcher)
    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "name": "eta", "training": {"train_iters": iters}}).json()["id"]
    sign_in(browser, env.server.url, env.tokens["alice"])
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, f'tr[data-id="{job_id}"]'), 30, "the job row")
    wait_for(lambda: (env.job(job_id)["iteration"] or 0) >= 10, 60, "ten iterations")
    row = f'tr[data-id="{job_id}"] .eta'
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, row), 20, "the ETA in the jobs list")
    browser.execute_script("location.hash = arguments[0]", f"#/jobs/{job_id}")

    def page_eta():
        facts = browser.find_elements(By.CSS_SELECTOR, '[data-fact="ETA"]')
        text = facts[0].text.replace("ETA", "").strip() if facts else ""
        return text if text and text != "–" else None

    shown = _eta_seconds(wait_for(page_eta, 30, "the ETA on the job page"))
    seen_at = time.monotonic()
    env.wait_state(job_id, "succeeded", timeout_s=120)
    real = time.monotonic() - seen_at
    print(f"\n[eta] shown {shown:.0f} s, real remaining {real:.1f} s (steps of {step_s} s)")
    assert abs(shown - real) <= ETA_MARGIN * real + 1.0, (shown, real)
    launcher.kill_all()


def test_the_list_reads_progress_from_postgres_too(start_env, fresh_pg_db):
    """The list reads only the needed keys of jobs.stats (JSON subscripts): SQLite and Postgres."""
    env = start_env(database_url=fresh_pg_db)
    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "training": {"train_iters": 100}}).json()["id"]
    env.wait_state(job_id, "starting")
    post_records(env, job_id, records(25))
    with env.client() as c:
        listed = c.get("/v1/jobs").json()["jobs"][0]
    assert (listed["progress"], listed["restart_s"]) == (0.25, 0.0) and listed["eta_s"] == pytest.approx(15.0)
