"""A straggler in the service: per-rank times from the records (service/stragglers.py) on the job
record, as an event, as Prometheus series, and on the job's page (a headless Chromium; skips
naming chromium / chromedriver when missing). The engine side, a rank slowed on purpose, is
tests/engine/test_rank_step_times.py."""

from __future__ import annotations

import re

from tests.service.test_api_jobs import TINY
from tests.service.test_ui import browser, post_records, ready_after, records, sign_in  # noqa: F401 (fixture)
from tests.waiting import wait_for


def with_ranks(n: int, slow_rank: int | None) -> list[dict]:
    out = []
    for r in records(n):
        times = [0.10, 0.11, 0.10, 0.105]
        if slow_rank is not None:
            times[slow_rank] = 0.2
        out.append({**r, "timers_per_rank": {"forward-backward": times}})
    return out


def test_a_slow_rank_is_flagged_on_the_record_as_an_event_and_in_metrics(env):
    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "training": {"train_iters": 100}}).json()["id"]
    env.wait_state(job_id, "starting")
    post_records(env, job_id, with_ranks(6, slow_rank=2))
    job = env.job(job_id)
    assert job["stragglers"] == [2] and job["rank_step_s"] == [0.10, 0.11, 0.2, 0.105]
    assert job["rank_slowness"][2] > 1.25 > max(job["rank_slowness"][:2] + job["rank_slowness"][3:])
    with env.client() as c:
        events = c.get(f"/v1/jobs/{job_id}/events", params={"kind": "straggler"}).json()["events"]
    (event,) = events
    assert event["data"]["rank"] == 2 and event["iteration"] == 3 and "rank 2 is a straggler" in event["message"]
    with env.client("admin") as admin:
        text = admin.get("/metrics").text
    assert re.search(rf'elastron_job_stragglers\{{job="{job_id}",tenant="alice"\}} 1(\.0)?\n', text)
    assert re.search(rf'elastron_job_rank_step_seconds\{{job="{job_id}",tenant="alice",rank="2"\}} 0\.2\n', text)
    assert f'elastron_job_rank_slowness_ratio{{job="{job_id}",tenant="alice",rank="3"}}' in text


def test_the_job_page_shows_each_rank_and_the_straggler(env, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "name": "ranks", "training": {"train_iters": 100}}).json()["id"]
    env.wait_state(job_id, "starting")
    post_records(env, job_id, with_ranks(6, slow_rank=1))
    sign_in(browser, env.server.url, env.tokens["alice"])
    wait_for(lambda: browser.execute_script("return window.elastronReady"), 20, "the jobs list")
    ready_after(browser, f"#/jobs/{job_id}")
    bars = browser.find_elements(By.CSS_SELECTOR, "#ranks .rank-bar")
    assert [b.get_attribute("data-rank") for b in bars] == ["0", "1", "2", "3"]
    assert [b.get_attribute("data-rank") for b in bars if "straggler" in b.get_attribute("class")] == ["1"]
    assert "Straggler: rank 1 (" in browser.find_element(By.ID, "straggler-flag").text
