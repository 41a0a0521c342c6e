"""The web UI (/ui): served by the API, driven in a real headless Chromium through its driver.

Debian's `chromium` and `chromium-driver` (`make browser` installs them; nothing is downloaded at
test time). Without them the browser tests skip naming what is missing; the HTTP-level tests
run anyway."""

from __future__ import annotations

import math
import re
import shutil

import httpx
import pytest

from tests.service.test_api_jobs import TINY
from tests.tools import missing_tool
from tests.waiting import wait_for


def records(n: int, start: int = 1) -> list[dict]:
    return [
        {
            "iteration": i,
            "loss": 6.0 * math.exp(-i / 200) + 1.0,
            "lr": 3e-4,
            "tokens": 1024,
            "tokens_per_s": 5000.0 + i,
            "mfu": 0.1,
            "step_time_s": 0.2,
            "timers": {"forward-backward": [0.15, 0.18]},
            **({"valid_loss": 5.0} if i % 10 == 0 else {}),
        }
        for i in range(start, start + n)
    ]


def post_records(env, job_id: str, recs: list[dict]) -> None:
    with env.client("admin") as admin:
        for k in range(0, len(recs), 5000):
            r = admin.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"records": recs[k : k + 5000]})
            assert r.status_code == 200, r.text


# -- over HTTP ------------------------------------------------------------------------------------


def test_the_ui_is_served_by_the_api_without_any_other_server(env):
    with httpx.Client(base_url=env.server.url) as c:
        r = c.get("/", follow_redirects=False)
        assert r.status_code in (302, 307) and r.headers["location"] == "/ui"
        page = c.get("/ui")
        assert page.status_code == 200 and "<title>elastron</title>" in page.text
        loaded = re.findall(r'(?:src|href)="([^"#]+)"', page.text)
        assert loaded and all(url.startswith("/ui/static/") for url in loaded), loaded  # no CDN
        for url in loaded:
            body = c.get(url)
            assert body.status_code == 200, url
            assert not re.search(r"(?:url\(|import |fetch\()\s*['\"]?https?://", body.text), url
        config = c.get("/ui/config").json()
        assert config["ray_dashboard_url"] is None  # ELASTRON_RAY_DASHBOARD_URL
        # The page's job states are the service's (it keeps no list of its own).
        from service.states import FINAL, JobState

        assert config["states"] == list(JobState) and set(config["final_states"]) == FINAL
        assert "succeeded" not in c.get("/ui/static/app.js").text


def test_the_job_list_carries_what_the_ui_shows(env):
    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "parallel": {"tensor": 2}, "resources": {"ranks": 4}}).json()["id"]
    post_records(env, job_id, records(3))
    with env.client() as c:
        job = c.get("/v1/jobs").json()["jobs"][0]
    assert (job["ranks"], job["layout"]) == (4, "tp2 pp1 cp1 dp2")
    assert job["loss"] == pytest.approx(records(3)[-1]["loss"]) and job["tokens_per_s"] == 5003.0
    assert job["mfu"] == 0.1 and job["started_at"] is not None


def test_metrics_downsample_on_the_server(start_env):
    env = start_env(reconcile=False)
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
    post_records(env, job_id, records(10_000))
    with env.client() as c:
        page = c.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 500}).json()
        iterations = [r["iteration"] for r in page["records"]]
        assert len(iterations) == 500 and iterations[0] == 1 and iterations[-1] == 10_000
        assert iterations == sorted(set(iterations)) and page["next_after"] is None
        few = c.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 500, "after": 9_990}).json()
        assert [r["iteration"] for r in few["records"]] == list(range(9_991, 10_001))


def test_parse_job_turns_yaml_into_the_object_to_submit(env):
    with env.client() as c:
        r = c.post("/ui/parse-job", content="name: x\nmodel:\n  num_layers: 3\n")
        assert r.json() == {"spec": {"name": "x", "model": {"num_layers": 3}}}
        assert c.post("/ui/parse-job", content="a: [1,").status_code == 422
        assert c.post("/ui/parse-job", content="- 1\n").status_code == 422
    with env.client(None) as anonymous:
        assert anonymous.post("/ui/parse-job", content="name: x").status_code == 401


# -- in a browser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    if missing:
        missing_tool(" and ".join(missing), "Debian packages chromium, chromium-driver: make browser")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def sign_in(browser, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{url}/ui")
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{url}/ui")
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "#signin-form button").click()


def ready_after(browser, hash_: str) -> float:
    """Navigate within the page and return when the view has drawn (ms since navigation start)."""
    browser.execute_script("window.elastronReady = null; location.hash = arguments[0];", hash_)
    wait_for(lambda: browser.execute_script("return window.elastronReady"), 30, f"{hash_} to draw")
    return browser.execute_script("return window.elastronReady")


def test_a_wrong_token_shows_the_sign_in_error(env, browser):
    from selenium.webdriver.common.by import By

    sign_in(browser, env.server.url, "elt_not-a-token")
    wait_for(lambda: "invalid or revoked" in browser.find_element(By.ID, "signin-error").text, 20, "the error")
    assert browser.find_element(By.ID, "nav").get_attribute("hidden") is not None


def test_sign_in_see_a_job_its_chart_points_and_cancel_it(env, browser):
    from selenium.webdriver.common.by import By

    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "name": "watched", "training": {"train_iters": 100}}).json()["id"]
    env.wait_state(job_id, "starting")
    post_records(env, job_id, records(37))
    sign_in(browser, env.server.url, env.tokens["alice"])
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, f'tr[data-id="{job_id}"]'), 20, "the job row")
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-id="{job_id}"]').text
    assert "watched" in row and "running" in row and "37/100" in row
    ready_after(browser, f"#/jobs/{job_id}")
    points = browser.find_element(By.ID, "chart-loss").get_attribute("data-points")
    assert points == "37"  # one point per metrics record
    assert "train_iters" in browser.find_element(By.ID, "spec").text
    browser.find_element(By.ID, "cancel").click()
    browser.switch_to.alert.accept()
    env.wait_state(job_id, "cancelled")
    wait_for(lambda: "cancelled" in browser.find_element(By.ID, "job-state").text, 20, "the page to show it")


def test_the_job_page_charts_each_tasks_scores_over_the_evaluated_checkpoints(env, browser):
    import json

    from selenium.webdriver.common.by import By

    from service.launcher import LaunchStatus
    from tests.service.test_api_evals import wait_eval
    from tests.service.test_api_exports import job_with_checkpoints

    job_id = job_with_checkpoints(env, saved=(10, 20, 30))
    with env.client() as c:
        rows = [c.post(f"/v1/jobs/{job_id}/checkpoints/{i}/evals", json={"tasks": ["elastron_mc"]}).json() for i in (10, 20, 30)]
    for k, row in enumerate(rows[:2]):  # two succeed, the third is still pending
        wait_for(lambda row=row: row["submission_id"] in env.launcher.submissions, 10, "the submission")
        result = {"results": {"elastron_mc": {"acc,none": 0.25 * (k + 1), "acc_norm,none": 0.5}}}
        env.launcher.logs_of[row["submission_id"]] = "eval-result " + json.dumps(result)
        env.launcher.set_status(row["submission_id"], LaunchStatus.SUCCEEDED)
    for row in rows[:2]:
        assert wait_eval(env, job_id, row["id"], ("succeeded", "failed"))["status"] == "succeeded"
    sign_in(browser, env.server.url, env.tokens["alice"])
    wait_for(lambda: browser.execute_script("return window.elastronReady"), 20, "the jobs list")
    ready_after(browser, f"#/jobs/{job_id}")
    chart = browser.find_element(By.ID, "eval-chart-elastron_mc")
    assert json.loads(chart.get_attribute("data-series")) == [
        {"label": "acc", "color": "#3559e0", "points": 2},
        {"label": "acc_norm", "color": "#e0703b", "points": 2},
    ]
    statuses = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#evals tbody tr")]
    assert len(statuses) == 3 and "pending" in statuses[2] and all("succeeded" in t for t in statuses[:2])


def test_a_bad_job_file_shows_the_fields_error(env, browser):
    from selenium.webdriver.common.by import By

    sign_in(browser, env.server.url, env.tokens["alice"])
    wait_for(lambda: browser.execute_script("return window.elastronReady"), 20, "the jobs list")
    ready_after(browser, "#/submit")
    text = "name: bad\nmodel:\n  num_attention_heads: 6\n  hidden_size: 96\nparallel:\n  tensor: 4\nresources:\n  ranks: 4\n"
    browser.find_element(By.ID, "job-text").send_keys(text)
    browser.find_element(By.ID, "submit").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "li.problem"), 20, "the error list")
    problem = browser.find_element(By.CSS_SELECTOR, "li.problem").text
    assert "num_attention_heads (6) is not divisible by parallel.tensor (4)" in problem


def test_page_load_with_1000_jobs_and_a_10000_record_job(start_env, browser):
    """Measured and printed, not asserted (a figure, not a timed test): the jobs page and the page
    of a job with 10,000 records (downsampled on the server) until drawn."""
    from selenium.webdriver.common.by import By

    env = start_env(reconcile=False, submit_burst=2000, submit_rate_per_minute=100000.0)
    with env.client() as c:
        ids = [c.post("/v1/jobs", json={**TINY, "name": f"j{i}"}).json()["id"] for i in range(1000)]
    post_records(env, ids[-1], records(10_000))
    sign_in(browser, env.server.url, env.tokens["alice"])
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "tr.job-row"), 30, "the jobs list")


    def load(url: str) -> float:  # a fresh page load: the figure counts from navigation start
        browser.get("about:blank")
        browser.get(url)
        wait_for(lambda: browser.execute_script("return window.elastronReady"), 30, url)
        return browser.execute_script("return window.elastronReady")

    jobs_ms = load(f"{env.server.url}/ui#/")
    job_ms = load(f"{env.server.url}/ui#/jobs/{ids[-1]}")
    points = int(browser.find_element(By.ID, "chart-loss").get_attribute("data-points"))
    print(f"\n[ui] jobs page (1,000 jobs, newest 100 listed): {jobs_ms:.0f} ms; job page (10,000 records, "
          f"{points} drawn): {job_ms:.0f} ms")
    assert 2 <= points <= 500
