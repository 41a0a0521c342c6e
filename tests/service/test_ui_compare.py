"""The web UI's compare view (#/compare?jobs=a,b,c): several jobs' curves on shared axes, one
colour per job, a legend, and a table of the spec fields that differ; in a real headless Chromium
(skips naming chromium / chromedriver when they are missing, like tests/service/test_ui.py)."""

from __future__ import annotations

import json

from tests.service.test_api_jobs import TINY
from tests.service.test_ui import browser, post_records, ready_after, records, sign_in  # noqa: F401 (fixture)
from tests.waiting import wait_for


def timed(n: int, step_s: float) -> list[dict]:
    return [{**r, "ts": 1_000_000.0 + step_s * r["iteration"]} for r in records(n)]


def drawn(driver, chart: str) -> list[dict]:
    """What the chart drew: each series' label, colour and point count (charts.js data-series)."""
    return json.loads(driver.execute_script(f"return document.getElementById('cmp-{chart}').dataset.series"))


def test_three_jobs_compared_with_coloured_series_and_the_differing_fields(start_env, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    env = start_env(reconcile=False)
    bodies = [
        {**TINY, "name": "base", "training": {"train_iters": 2000, "global_batch_size": 2}, "optimizer": {"lr": 3e-4}},
        {**TINY, "name": "higher-lr", "training": {"train_iters": 2000, "global_batch_size": 2}, "optimizer": {"lr": 1e-3}},
        {**TINY, "name": "deeper", "model": {"num_layers": 4}, "training": {"train_iters": 2000, "global_batch_size": 2}, "optimizer": {"lr": 3e-4}},
    ]
    counts = [30, 45, 1200]  # the last is downsampled by the server to 500
    with env.client() as c:
        created = [c.post("/v1/jobs", json=b) for b in bodies]
    assert all(r.status_code == 201 for r in created), [r.text for r in created]
    ids = [r.json()["id"] for r in created]
    for job_id, n, step in zip(ids, counts, [0.2, 0.1, 0.3], strict=True):
        post_records(env, job_id, timed(n, step))
    sign_in(browser, env.server.url, env.tokens["alice"])
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "tr.job-row"), 20, "the jobs list")

    # Pick them in the list: Compare opens #/compare?jobs=...
    for job_id in ids:
        browser.find_element(By.CSS_SELECTOR, f'input.pick-job[value="{job_id}"]').click()
    browser.execute_script("window.elastronReady = null")
    browser.find_element(By.ID, "compare").click()
    wait_for(lambda: browser.execute_script("return window.elastronReady"), 30, "the compare view")
    assert sorted(browser.execute_script("return location.hash").split("jobs=")[1].split(",")) == sorted(ids)

    ready_after(browser, f"#/compare?jobs={','.join(ids)}")  # the URL alone opens it too
    loss = drawn(browser, "loss")
    train = [s for s in loss if not s["label"].endswith("valid")]
    valid = [s for s in loss if s["label"].endswith("valid")]
    assert [s["label"] for s in train] == ["base", "higher-lr", "deeper"]
    assert [s["points"] for s in train] == [30, 45, 500]
    with env.client() as c:  # valid loss on every 10th record: those the server's downsampling kept
        served = [c.get(f"/v1/jobs/{i}/metrics", params={"max_points": 500}).json()["records"] for i in ids]
    assert [s["points"] for s in valid] == [sum("valid_loss" in r for r in recs) for recs in served] != [0, 0, 0]
    colours = [s["color"] for s in train]
    assert len(set(colours)) == 3 and [s["color"] for s in valid] == colours  # one colour per job
    for chart in ("throughput", "mfu", "step", "lr"):
        assert [(s["color"], s["points"]) for s in drawn(browser, chart)] == list(zip(colours, [30, 45, 500], strict=True))
    legend = browser.find_elements(By.CSS_SELECTOR, "#legend .legend-item")
    assert [(e.get_attribute("data-id"), e.get_attribute("data-color")) for e in legend] == list(zip(ids, colours, strict=True))

    fields = [tr.get_attribute("data-field") for tr in browser.find_elements(By.CSS_SELECTOR, "#diff tbody tr")]
    assert set(fields) == {"name", "optimizer.lr", "model.num_layers"}, fields
    lr_row = browser.find_element(By.CSS_SELECTOR, '#diff tr[data-field="optimizer.lr"]').text
    assert "0.0003" in lr_row and "0.001" in lr_row

    ready_after(browser, f"#/compare?jobs={','.join(ids)}&x=tokens")  # tokens consumed
    assert [s["points"] for s in drawn(browser, "lr")] == [30, 45, 500]
    ready_after(browser, f"#/compare?jobs={','.join(ids)}&x=time")  # wall time from the records' ts
    assert [s["points"] for s in drawn(browser, "step")] == [30, 45, 500]
    assert browser.find_element(By.ID, "axis").get_attribute("value") == "time"
