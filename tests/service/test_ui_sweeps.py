"""The web UI's sweep pages (#/sweeps, #/sweeps/<id>, service/ui/sweeps.js) on a sweep run through
the real API and reconciler with a fake launcher: the trials table with the best trial
highlighted, every trial's curve on one chart, one scatter per varied field, and the link into
the compare view; in a real headless Chromium (skips naming chromium / chromedriver when they
are missing, like tests/service/test_ui.py)."""

from __future__ import annotations

import json

from tests.service.test_sweeps import ITERS, launched_trials, run_to_end, submit, sweep_body
from tests.service.test_ui import browser, ready_after, sign_in  # noqa: F401 (fixture)
from tests.waiting import wait_for


def drawn(driver, canvas: str) -> list[dict]:
    return json.loads(driver.execute_script(f"return document.getElementById('{canvas}').dataset.series"))


def test_a_sweeps_trials_curves_and_best_trial_are_shown(env, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    body = sweep_body(
        search_space={
            "optimizer.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
            "training.global_batch_size": {"type": "choice", "values": [2, 4]},
        },
        pruner={"name": "none"},
        budget={"max_trials": 3, "max_parallel": 3},
    )
    sid = submit(env, body)["id"]
    trials = launched_trials(env, sid, 3)
    for t, scale in zip(trials, [1.0, 0.5, 2.0], strict=True):
        run_to_end(env, t["job_id"], scale)
    with env.client() as c:
        done = wait_for(lambda: (s := c.get(f"/v1/sweeps/{sid}").json())["state"] == "completed" and s, 30, "done")
    best = done["best"]["number"]
    assert best == trials[1]["number"]

    sign_in(browser, env.server.url, env.tokens["alice"])
    ready_after(browser, "#/sweeps")
    # Waited for: on a loaded machine the list's rows came after the page's ready mark (CI, stop 74).
    wait_for(
        lambda: [r.get_attribute("data-id") for r in browser.find_elements(By.CSS_SELECTOR, "tr.sweep-row")] == [sid],
        15,
        "the sweep listed",
    )

    ready_after(browser, f"#/sweeps/{sid}")
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.trial-row")
    assert [int(r.get_attribute("data-number")) for r in rows] == [t["number"] for t in trials]
    highlighted = browser.find_elements(By.CSS_SELECTOR, "tr.trial-row.best")
    assert [int(r.get_attribute("data-number")) for r in highlighted] == [best]
    curves = drawn(browser, "sweep-curves")
    assert [s["points"] for s in curves] == [ITERS] * 3
    best_colour = {s["label"]: s["color"] for s in curves}[f"#{best}"]
    assert sum(s["color"] == best_colour for s in curves) == 1  # the best stands out
    for k, field in enumerate(["optimizer.lr", "training.global_batch_size"]):
        canvas = browser.find_element(By.ID, f"sweep-param-{k}")
        assert canvas.get_attribute("data-field") == field
        assert [s["points"] for s in drawn(browser, f"sweep-param-{k}")] == [1, 1, 1]
    link = browser.find_element(By.ID, "compare-trials").get_attribute("href")
    assert sorted(link.split("jobs=")[1].split(",")) == sorted(t["job_id"] for t in trials)
