"""The /v1/jobs API over HTTP against a running app (launcher: FakeLauncher), every 4xx path included."""

from __future__ import annotations

import httpx
import pytest

from service.launcher import LaunchStatus, SubmissionRejected
from tests.waiting import wait_for

TINY = {"name": "tiny", "training": {"train_iters": 4, "global_batch_size": 2}}


def submit(c: httpx.Client, body=TINY, **headers) -> httpx.Response:
    return c.post("/v1/jobs", json=body, headers=headers)


def test_submit_returns_201_with_the_job_and_launches_it(env):
    with env.client() as c:
        r = submit(c)
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["state"] == "queued" and job["tenant"] == "alice" and job["name"] == "tiny"
        assert r.headers["location"] == f"/v1/jobs/{job['id']}"
        # The stored spec is the one that runs: defaults filled in, a per-job checkpoint folder.
        assert job["spec"]["training"]["train_iters"] == 4 and job["spec"]["model"]["arch"] == "llama"
        assert job["spec"]["checkpoint"]["path"].endswith("/checkpoints/alice")  # workers add /<job id>
    started = env.wait_state(job["id"], "starting")
    assert started["submission_id"] == f"elastron-{job['id']}-1" and started["attempt"] == 1
    sent = env.launcher.env_of(job["id"])
    assert sent["ELASTRON_JOB_ID"] == job["id"]
    assert sent["ELASTRON_API_URL"] == env.server.url
    assert sent["ELASTRON_API_TOKEN"].startswith("elj_")
    assert '"train_iters":4' in sent["ELASTRON_JOB_SPEC"]


def test_job_lifecycle_events_and_success(env):
    with env.client() as c:
        job_id = submit(c).json()["id"]
        env.wait_state(job_id, "starting")
        sid = env.job(job_id)["submission_id"]
        env.launcher.set_status(sid, LaunchStatus.SUCCEEDED)
        done = env.wait_state(job_id, "succeeded")
        assert done["finished_at"] is not None and done["failure_cause"] is None
        events = c.get(f"/v1/jobs/{job_id}/events").json()["events"]
    states = [(e["data"].get("from"), e["data"].get("to")) for e in events if e["kind"] == "state"]
    assert states == [(None, "queued"), ("queued", "starting"), ("starting", "succeeded")]
    assert [e["kind"] for e in events].count("launch") == 1
    assert all(e["message"] for e in events if e["kind"] == "state")


def test_failure_cause_comes_from_the_launcher(env):
    with env.client() as c:
        job_id = submit(c).json()["id"]
    env.wait_state(job_id, "starting")
    sid = env.job(job_id)["submission_id"]
    # The exit code is data (Ray's driver_exit_code), not read out of the message's text.
    env.launcher.set_status(sid, LaunchStatus.FAILED, "Job entrypoint command failed, last logs: x", exit_code=17)
    failed = env.wait_state(job_id, "failed")
    assert failed["failure_cause"].startswith("a result failed validation (rerun state machine, exit 17)")
    assert failed["failure_cause"].endswith("last logs: x")


@pytest.mark.parametrize(
    "exit_code, meaning",
    [(1, ""), (16, "the rerun state machine needs the job resumed on other hardware, which the cluster lacks (exit 16): ")],
)
def test_the_drivers_reason_is_the_failure_cause(env, exit_code, meaning):
    """With the meaning of the driver's exit code where the engine gave it one."""
    with env.client() as c:
        job_id = submit(c).json()["id"]
    sid = env.wait_state(job_id, "starting")["submission_id"]
    event = {"kind": "job_failed", "reason": "rank 0 raised: out of memory", "exit_code": exit_code, "ts": 9.0}
    with env.client("admin") as admin:
        assert (
            admin.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"events": [event]}).status_code == 200
        )
    env.launcher.set_status(
        sid, LaunchStatus.FAILED, "Job entrypoint command failed with exit code 1, logs: ..."
    )
    failed = env.wait_state(job_id, "failed")
    assert failed["failure_cause"] == meaning + "rank 0 raised: out of memory"
    with env.client() as c:
        (state,) = [
            e for e in c.get(f"/v1/jobs/{job_id}/events").json()["events"] if e["data"].get("to") == "failed"
        ]
    assert "exit code 1" in state["data"]["launcher_message"]


def test_a_rejected_submission_is_retried_then_fails_the_job(start_env):
    env = start_env(max_launch_attempts=2)
    env.launcher.reject_with = SubmissionRejected("bad runtime env")
    with env.client() as c:
        job_id = submit(c).json()["id"]
        failed = env.wait_state(job_id, "failed")
        kinds = [e["kind"] for e in c.get(f"/v1/jobs/{job_id}/events").json()["events"]]
    assert kinds.count("launch_failed") == 2
    assert "bad runtime env" in failed["failure_cause"]


def test_list_filters_by_state_and_paginates(env):
    with env.client() as c:
        ids = [submit(c, {**TINY, "name": f"job{i}"}).json()["id"] for i in range(5)]
        c.post(f"/v1/jobs/{ids[0]}/cancel")  # may race the dispatcher: cancelled now or after the stop
        env.wait_state(ids[0], "cancelled")
        seen, cursor = [], None
        while True:
            page = c.get("/v1/jobs", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
            seen += [j["id"] for j in page["jobs"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == ids[::-1]  # newest first, each once
        cancelled = c.get("/v1/jobs", params={"state": "cancelled"}).json()["jobs"]
        assert [j["id"] for j in cancelled] == [ids[0]]


def test_idempotency_key_returns_the_same_job(env):
    with env.client() as c:
        first = submit(c, **{"Idempotency-Key": "abc"})
        again = submit(c, **{"Idempotency-Key": "abc"})
        assert first.status_code == again.status_code == 201
        assert again.json()["id"] == first.json()["id"]
        assert again.headers.get("idempotent-replayed") == "true"
        other = submit(c, {**TINY, "name": "other"}, **{"Idempotency-Key": "abc"})
        assert other.status_code == 422
        assert other.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
        assert len(c.get("/v1/jobs").json()["jobs"]) == 1
    with env.client("bob") as c:  # keys are per tenant
        assert submit(c, **{"Idempotency-Key": "abc"}).json()["id"] != first.json()["id"]


def test_invalid_specs_are_422_naming_the_field_and_the_fix(env):
    with env.client() as c:
        r = submit(
            c,
            {
                "model": {"hidden_size": 96, "num_attention_heads": 6},
                "parallel": {"tensor": 4},
                "resources": {"ranks": 4},
            },
        )
        assert r.status_code == 422
        (problem,) = r.json()["detail"]
        assert problem["loc"] == ["body", "model", "num_attention_heads"]
        assert "choose parallel.tensor from 1, 2, 3, 6" in problem["msg"]

        r = submit(c, {"parallel": {"tensor_model_parallel_size": 2}, "training": {"train_iters": 0}})
        detail = r.json()["detail"]
        assert r.status_code == 422 and len(detail) == 2
        assert {tuple(d["loc"]) for d in detail} == {
            ("body", "parallel", "tensor_model_parallel_size"),
            ("body", "training", "train_iters"),
        }
        assert any("did you mean 'tensor'" in d["msg"] for d in detail)

        assert (
            submit(c, ["not", "a", "mapping"])
            .json()["detail"][0]["msg"]
            .startswith("the body must be a JSON object")
        )
        r = c.post("/v1/jobs", content=b"{nope", headers={"content-type": "application/json"})
        assert r.status_code == 422 and "not valid JSON" in r.json()["detail"][0]["msg"]


def test_resume_from_another_job(env):
    with env.client() as c:
        source = submit(c).json()
        r = submit(c, {**TINY, "checkpoint": {"resume_from": f"job:{source['id']}"}})
        assert r.status_code == 201, r.text
        where = f"{source['spec']['checkpoint']['path']}/{source['id']}/tiny"  # <path>/<job id>/<name>
        assert r.json()["spec"]["checkpoint"]["resume_from"] == where
        r = submit(c, {**TINY, "checkpoint": {"resume_from": f"job:{source['id']}/iter_0000004"}})
        assert r.json()["spec"]["checkpoint"]["resume_from"] == f"{where}/iter_0000004"
        for bad in (f"job:{source['id']}/latest", "job:nope-00000000"):
            r = submit(c, {**TINY, "checkpoint": {"resume_from": bad}})
            assert r.status_code == 422
            assert r.json()["detail"][0]["loc"] == ["body", "checkpoint", "resume_from"]
    with env.client("bob") as c:  # another tenant's job is not a source
        r = submit(c, {**TINY, "checkpoint": {"resume_from": f"job:{source['id']}"}})
        assert r.status_code == 422 and "no job" in r.json()["detail"][0]["msg"]


def test_query_and_path_errors(env):
    with env.client() as c:
        for params in ({"state": "sleeping"}, {"limit": 0}, {"limit": 501}, {"cursor": "x"}):
            r = c.get("/v1/jobs", params=params)
            assert r.status_code == 422, params
            assert r.json()["detail"][0]["loc"][0] == "query"
        job_id = submit(c).json()["id"]
        assert c.get(f"/v1/jobs/{job_id}/metrics", params={"after": -2}).status_code == 422
        assert c.get(f"/v1/jobs/{job_id}/events", params={"limit": 0}).status_code == 422
        for path in ("", "/events", "/metrics", "/logs", "/checkpoints"):
            r = c.get(f"/v1/jobs/nope-12345678{path}")
            assert r.status_code == 404 and "nope-12345678" in r.json()["detail"], path
        assert c.post("/v1/jobs/nope-12345678/cancel").status_code == 404
        assert c.get("/v1/nothing-here").status_code == 404
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 405


def test_missing_or_wrong_token_is_401(env):
    for client in (env.client(None), env.client(token="elt_wrong"), env.client(token="elj_a-job-token")):
        with client as c:
            for method, path in (
                ("GET", "/v1/jobs"),
                ("POST", "/v1/jobs"),
                ("GET", "/v1/jobs/x"),
                ("POST", "/v1/jobs/x/cancel"),
                ("GET", "/v1/jobs/x/logs"),
            ):
                r = c.request(method, path, json=TINY if method == "POST" else None)
                assert r.status_code == 401, (method, path, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
    with httpx.Client(base_url=env.server.url) as c:  # not a Bearer scheme
        assert c.get("/v1/jobs", headers={"Authorization": f"Basic {env.tokens['alice']}"}).status_code == 401


def test_cancel_paths(env):
    env.launcher.up = False  # nothing gets launched: the job stays queued
    with env.client() as c:
        queued = submit(c).json()["id"]
        r = c.post(f"/v1/jobs/{queued}/cancel")
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
        assert c.post(f"/v1/jobs/{queued}/cancel").status_code == 200  # idempotent
        env.launcher.up = True
        running = submit(c).json()["id"]
        env.wait_state(running, "starting")
        r = c.post(f"/v1/jobs/{running}/cancel")
        assert r.status_code == 202 and r.json()["cancel_requested_at"] is not None
        done = env.wait_state(running, "cancelled")
        assert env.launcher.stopped == [done["submission_id"]]
        kinds = [e["kind"] for e in c.get(f"/v1/jobs/{running}/events").json()["events"]]
        assert kinds.index("cancel_requested") < kinds.index("stop_sent")
        finished = submit(c).json()["id"]
        env.wait_state(finished, "starting")
        env.launcher.set_status(env.job(finished)["submission_id"], LaunchStatus.SUCCEEDED)
        env.wait_state(finished, "succeeded")
        r = c.post(f"/v1/jobs/{finished}/cancel")
        assert r.status_code == 409 and "already succeeded" in r.json()["detail"]


def test_ray_unreachable_jobs_wait_logs_503_readyz_degraded(env):
    env.launcher.up = False
    with env.client() as c:
        job_id = submit(c).json()["id"]
        assert wait_for(lambda: c.get("/readyz").json()["status"] == "degraded", what="readyz degraded")
        r = c.get("/readyz")
        assert r.status_code == 200 and r.json()["store"] == "ok" and r.json()["ray"] == "unreachable"
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get(f"/v1/jobs/{job_id}/logs").text == ""  # not launched: no logs yet
        assert env.job(job_id)["state"] == "queued"
        env.launcher.up = True
        sid = env.wait_state(job_id, "starting")["submission_id"]
        env.launcher.up = False
        for follow in ("false", "true"):
            r = c.get(f"/v1/jobs/{job_id}/logs", params={"follow": follow})
            assert r.status_code == 503 and "retry later" in r.json()["detail"] and r.headers["retry-after"]
        env.launcher.up = True
        assert c.get(f"/v1/jobs/{job_id}/logs").text == f"log of {sid}\n"
        assert wait_for(lambda: c.get("/readyz").json()["status"] == "ok", what="readyz ok")


def test_logs_follow_streams(env):
    with env.client() as c:
        job_id = submit(c).json()["id"]
        sid = env.wait_state(job_id, "starting")["submission_id"]
        env.launcher.set_status(sid, LaunchStatus.SUCCEEDED)
        env.wait_state(job_id, "succeeded")
        with c.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": "true"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            text = "".join(r.iter_text())
    assert text == "".join(f"line {i} of {sid}\n" for i in range(3))


def test_a_broken_log_stream_is_resumed_without_repeating_lines(env, monkeypatch):
    monkeypatch.setattr("service.routers.logs._FOLLOW_RETRY_S", 0.01)
    with env.client() as c:
        job_id = submit(c).json()["id"]
        sid = env.wait_state(job_id, "starting")["submission_id"]
        env.launcher.set_status(sid, LaunchStatus.SUCCEEDED)
        env.wait_state(job_id, "succeeded")
        env.launcher.break_tail_after = 2
        text = c.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"}).text
    assert text == "".join(f"line {i} of {sid}\n" for i in range(3))
    assert env.launcher.tails == 2


def test_body_size_limit_is_413(start_env):
    env = start_env(max_body_bytes=4096)
    with env.client() as c:
        big = {**TINY, "name": "x", "data": {"path": "a" * 8000}}
        r = submit(c, big)
        assert r.status_code == 413 and "ELASTRON_MAX_BODY_BYTES" in r.json()["detail"]

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"name": "x", "data": {"path": "'
            for _ in range(10):
                yield b"a" * 1000
            yield b'"}}'

        r = c.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert submit(c).status_code == 201


def test_submission_rate_limit_is_429_per_tenant(start_env):
    env = start_env(submit_rate_per_minute=1, submit_burst=2)
    with env.client() as c:
        assert [submit(c).status_code for _ in range(3)] == [201, 201, 429]
        r = submit(c)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert submit(c, **{"Idempotency-Key": "k"}).status_code == 429
    with env.client("bob") as c:
        assert submit(c).status_code == 201


def test_openapi_and_docs_are_served(env):
    with httpx.Client(base_url=env.server.url) as c:
        schema = c.get("/openapi.json").json()
        assert c.get("/docs").status_code == 200
    paths = schema["paths"]
    for path in (
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/events",
        "/v1/jobs/{job_id}/metrics",
        "/v1/jobs/{job_id}/logs",
        "/v1/jobs/{job_id}/checkpoints",
        "/v1/internal/jobs/{job_id}/telemetry",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in paths, path
    body = paths["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/JobSpec")


def test_a_job_asking_for_checkpoints_without_a_path_gets_the_services_root(start_env):
    """README: ELASTRON_HOME holds `checkpoints/` for jobs that set no checkpoint.path. Over REST
    `checkpoint: {interval: 5}` alone is a job, and the spec as run records the path chosen."""
    env = start_env(checkpoint_dir=None)  # the default: <home>/checkpoints
    with env.client() as c:
        r = c.post("/v1/jobs", json={**TINY, "checkpoint": {"interval": 5}})
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["checkpoint"]["path"] == str(env.settings.home / "checkpoints" / "alice")
    with env.client("admin") as admin:  # a bucket of alice's own: granted by an admin (issue 61)
        assert admin.put("/v1/tenants/alice/storage", json={"roots": ["s3://bucket/mine"]}).status_code == 200
    with env.client() as c:
        mine = {**TINY, "checkpoint": {"interval": 5, "path": "s3://bucket/mine"}}
        assert c.post("/v1/jobs", json=mine).json()["spec"]["checkpoint"]["path"] == "s3://bucket/mine"
    other = start_env(checkpoint_dir="s3://bucket/jobs/")
    with other.client("bob") as c:
        r = c.post("/v1/jobs", json={**TINY, "checkpoint": {"interval": 5}})
        assert r.status_code == 201 and r.json()["spec"]["checkpoint"]["path"] == "s3://bucket/jobs/bob"
