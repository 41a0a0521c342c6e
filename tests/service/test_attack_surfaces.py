"""Issue 61, the service's surfaces: what an anonymous client or an ordinary tenant learns from the
routes outside /v1 (/metrics, /readyz, /ui/config, the /ui pages), and what a Ray outage does to
readiness."""

from __future__ import annotations

import logging

import httpx
from sqlalchemy.exc import OperationalError

from service.routers import health
from tests.service.test_api_jobs import TINY
from tests.service.test_ui import browser, post_records, ready_after, records, sign_in  # noqa: F401
from tests.waiting import wait_for

INTERNAL_RAY = "http://ray-head.cluster.internal:8265"


def scrape(env) -> str:
    """/metrics as Prometheus reads it: with a token (an admin's here; a deployment's scrape token)."""
    with env.client("admin") as c:
        r = c.get("/metrics")
    assert r.status_code == 200, r.text
    return r.text


def test_metrics_need_the_scrape_token_or_an_admin(start_env):
    env = start_env(reconcile=False, metrics_token="scrape-secret-0123456789")
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
    with env.client(None) as anonymous:
        r = anonymous.get("/metrics")
        assert r.status_code == 401 and job_id not in r.text and r.headers["www-authenticate"] == "Bearer"
    with env.client(token="wrong") as c:
        assert c.get("/metrics").status_code == 401
    with env.client("bob") as c:  # a tenant token lists no other tenant's job ids either
        r = c.get("/metrics")
        assert r.status_code == 403 and "ELASTRON_METRICS_TOKEN" in r.json()["detail"]
    with env.client(token="scrape-secret-0123456789") as c:
        r = c.get("/metrics")
        assert r.status_code == 200 and f'job="{job_id}"' in r.text
    with env.client("admin") as c:
        assert c.get("/metrics").status_code == 200
    # Without a scrape token configured, admins still scrape; the operator may open it on purpose.
    assert start_env(reconcile=False).client(None).get("/metrics").status_code == 401
    assert (
        start_env(reconcile=False, metrics_require_token=False).client(None).get("/metrics").status_code
        == 200
    )


def test_readyz_names_no_error_text_and_logs_it(start_env, monkeypatch, caplog):
    env = start_env(reconcile=False, ray_address=INTERNAL_RAY)

    def broken(_ctx):
        raise OperationalError("SELECT 1", {}, Exception("password authentication failed for db.internal"))

    monkeypatch.setattr(health, "_store_ok", broken)
    with caplog.at_level(logging.WARNING, logger="service"), env.client(None) as c:
        r = c.get("/readyz")
    assert r.status_code == 503, r.text
    assert r.json()["store"] == "unreachable"
    assert "db.internal" not in r.text and "password" not in r.text and "OperationalError" not in r.text
    assert "db.internal" in caplog.text  # the operator still finds it, in the log


def test_ray_down_leaves_the_api_ready_and_degraded(start_env):
    env = start_env(ray_address=INTERNAL_RAY)
    env.launcher.up = False
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
        body = wait_for(
            lambda: (r := c.get("/readyz")).json().get("ray") == "unreachable" and r, what="ray down"
        )
        assert body.status_code == 200 and body.json() == {
            "ready": True,
            "status": "degraded",
            "store": "ok",
            "ray": "unreachable",
        }
        # The routes that need no Ray answer as usual: cancel is recorded.
        assert c.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
        env.launcher.up = True
        ok = wait_for(lambda: (r := c.get("/readyz")).json().get("ray") == "ok" and r, what="ray back")
        assert ok.status_code == 200 and ok.json()["status"] == "ok"


def test_ui_config_and_logs_errors_name_no_internal_address(start_env):
    env = start_env(ray_address=INTERNAL_RAY)
    with httpx.Client(base_url=env.server.url) as c:
        r = c.get("/ui/config")
    assert r.status_code == 200 and "internal" not in r.text and r.json()["ray_dashboard_url"] is None
    public = start_env(ray_address=INTERNAL_RAY, ray_dashboard_url="https://ray.example.com")
    with httpx.Client(base_url=public.server.url) as c:
        assert c.get("/ui/config").json()["ray_dashboard_url"] == "https://ray.example.com"
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
        env.wait_state(job_id, "starting")
        env.launcher.up = False
        r = c.get(f"/v1/jobs/{job_id}/logs")
    assert r.status_code == 503 and "internal" not in r.text and "FakeLauncher" not in r.text


def test_ui_pages_carry_csp_and_frame_headers(env):
    with httpx.Client(base_url=env.server.url) as c:
        for path in ("/ui", "/ui/static/app.js", "/ui/static/style.css"):
            r = c.get(path)
            assert r.status_code == 200, path
            csp = r.headers.get("content-security-policy", "")
            assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, (path, csp)
            assert "script-src 'self'" in csp and "unsafe-eval" not in csp and "object-src 'none'" in csp
            assert r.headers.get("x-frame-options") == "DENY", path
            assert r.headers.get("x-content-type-options") == "nosniff", path
        api = c.get("/healthz")
        assert api.headers.get("x-content-type-options") == "nosniff"


def test_the_ui_runs_under_its_csp_without_a_violation(env, browser):  # noqa: F811 (the fixture)
    """The pages' own scripts and styles satisfy the policy: every view drawn, no violation."""
    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "name": "csp"}).json()["id"]
    env.wait_state(job_id, "starting")
    post_records(env, job_id, records(5))
    sign_in(browser, env.server.url, env.tokens["alice"])
    wait_for(lambda: browser.execute_script("return window.elastronReady"), 30, "the jobs list")
    browser.execute_script(
        "window.cspViolations = [];"
        "document.addEventListener('securitypolicyviolation',"
        " (e) => window.cspViolations.push(e.violatedDirective + ' ' + e.blockedURI));"
    )
    for view in ("#/", f"#/jobs/{job_id}", f"#/compare?jobs={job_id}", "#/queue", "#/submit"):
        ready_after(browser, view)
    assert browser.execute_script("return window.cspViolations") == []
