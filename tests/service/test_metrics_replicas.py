"""Issue 61: with several API replicas, each exports every job's series. The recording rules take
the max across replicas (`instance`) before summing (deploy/prometheus/rules; promtool proof in
deploy/prometheus/tests/elastron-replicas.test.yml), which is right only because every replica
exports the same values: they all read them from the one store. This checks that premise: two
API instances over one store give the same per-job series."""

from __future__ import annotations

import httpx

from engine.launcher import free_port
from tests.service.conftest import ApiServer
from tests.service.test_api_jobs import TINY


def _job_series(server: ApiServer) -> list[str]:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer scrape-token"}, timeout=30).text
    return sorted(line for line in text.splitlines() if line.startswith("elastron_job_"))


def test_two_replicas_export_the_same_per_job_series(start_env):
    env = start_env(reconcile=False, metrics_token="scrape-token")
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
    records = [{"iteration": i, "loss": 2.0, "tokens": 600, "step_time_s": 1.0} for i in (1, 2, 3)]
    with env.client("admin") as admin:
        assert admin.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"records": records}).status_code == 200
    second = ApiServer(env.settings.model_copy(), env.launcher, free_port(), reconcile=False).start()
    try:
        one, two = _job_series(env.server), _job_series(second)
        assert any(f'elastron_job_tokens_total{{job="{job_id}"' in line for line in one)
        assert one == two
    finally:
        second.stop()
