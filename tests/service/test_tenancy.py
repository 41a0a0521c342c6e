"""Tenancy: a tenant neither sees nor touches another tenant's jobs (404, as if they did not
exist); an admin sees and cancels everyone's."""

from __future__ import annotations

from tests.service.test_api_jobs import TINY


def test_a_tenant_cannot_read_list_cancel_or_feed_another_tenants_job(env):
    with env.client("bob") as bob:
        bobs = bob.post("/v1/jobs", json=TINY).json()["id"]
    with env.client("alice") as alice:
        alices = alice.post("/v1/jobs", json=TINY).json()["id"]
        for path in ("", "/events", "/metrics", "/logs", "/checkpoints"):
            r = alice.get(f"/v1/jobs/{bobs}{path}")
            assert r.status_code == 404, path
            assert (
                r.json()["detail"] == f"no job {bobs!r}"
            )  # the same answer as for a job that does not exist
        assert alice.post(f"/v1/jobs/{bobs}/cancel").status_code == 404
        r = alice.post(f"/v1/internal/jobs/{bobs}/telemetry", json={"records": [{"iteration": 1}]})
        assert r.status_code == 404
        assert [j["id"] for j in alice.get("/v1/jobs").json()["jobs"]] == [alices]
        assert alice.get("/v1/jobs", params={"tenant": "bob"}).json()["jobs"] == []  # the filter cannot widen
    assert env.job(bobs, "bob")["state"] != "cancelled"
    assert env.job(bobs, "bob")["iteration"] is None


def test_admin_sees_all_and_can_cancel(env):
    ids = {}
    for who in ("alice", "bob"):
        with env.client(who) as c:
            ids[who] = c.post("/v1/jobs", json=TINY).json()["id"]
    with env.client("admin") as admin:
        listed = {j["id"]: j["tenant"] for j in admin.get("/v1/jobs").json()["jobs"]}
        assert listed == {ids["alice"]: "alice", ids["bob"]: "bob"}
        only_bob = admin.get("/v1/jobs", params={"tenant": "bob"}).json()["jobs"]
        assert [j["id"] for j in only_bob] == [ids["bob"]]
        assert admin.get(f"/v1/jobs/{ids['bob']}").json()["tenant"] == "bob"
        assert admin.post(f"/v1/jobs/{ids['bob']}/cancel").status_code in (200, 202)
    assert env.wait_state(ids["bob"], "cancelled")


def test_a_job_token_only_feeds_its_own_job(env):
    with env.client("alice") as c:
        first = c.post("/v1/jobs", json=TINY).json()["id"]
        second = c.post("/v1/jobs", json=TINY).json()["id"]
    env.wait_state(first, "starting")
    env.wait_state(second, "starting")
    token = env.launcher.env_of(first)["ELASTRON_API_TOKEN"]
    with env.client(token=token) as worker:
        assert (
            worker.post(
                f"/v1/internal/jobs/{first}/telemetry", json={"records": [{"iteration": 1}]}
            ).status_code
            == 200
        )
        r = worker.post(f"/v1/internal/jobs/{second}/telemetry", json={"records": [{"iteration": 1}]})
        assert r.status_code == 401
        # ... and is no user token: the job API refuses it.
        assert worker.get(f"/v1/jobs/{first}").status_code == 401
        assert worker.get("/v1/jobs").status_code == 401
    with env.client(token="elj_forged") as forged:
        assert forged.post(f"/v1/internal/jobs/{first}/telemetry", json={"records": []}).status_code == 401
    with env.client(None) as anonymous:
        assert anonymous.post(f"/v1/internal/jobs/{first}/telemetry", json={"records": []}).status_code == 401
