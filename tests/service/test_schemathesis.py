"""Property-based fuzzing of the OpenAPI schema (Schemathesis) against a live API: no generated
request, valid or not, gets a 5xx. Bounded (10 generated examples per operation, plus the coverage phase) to fit the CI budget.

The operations are collected from the app's schema at import (Schemathesis' lazy fixture loader
does not run on this pytest); the test first checks that the live server serves that very
schema, then fuzzes the live server."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from engine.launcher import free_port
from service.app import create_app
from service.launcher import LaunchStatus
from service.settings import Settings
from tests.service.conftest import ApiServer, make_settings, make_tokens
from tests.service.launchers import FakeLauncher
from tests.waiting import wait_for

OPENAPI = create_app(Settings(database_url="sqlite://"), launcher=FakeLauncher()).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)


@pytest.fixture(scope="module")
def live_api(tmp_path_factory):
    port, launcher = free_port(), FakeLauncher()
    config = make_settings(
        tmp_path_factory.mktemp("fuzz"), None, port, submit_rate_per_minute=6000.0, submit_burst=1000
    )
    tokens = make_tokens(config)
    server = ApiServer(config, launcher, port).start()
    import httpx

    assert httpx.get(f"{server.url}/openapi.json").json() == OPENAPI
    # One real job, so per-job operations get past the 404 and into their own parameters.
    auth = {"Authorization": f"Bearer {tokens['admin']}"}
    job_id = httpx.post(f"{server.url}/v1/jobs", json={"name": "fuzz"}, headers=auth).json()["id"]
    record = {"iteration": 1, "loss": 1.0, "tokens": 8, "step_time_s": 0.1}
    httpx.post(f"{server.url}/v1/internal/jobs/{job_id}/telemetry", json={"records": [record]}, headers=auth)
    # Finished, so a followed log ends when Ray's stream does.
    launcher.set_status(f"elastron-{job_id}-1", LaunchStatus.SUCCEEDED)
    wait_for(lambda: httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=auth).json()["state"] == "succeeded")
    yield server, tokens, job_id
    server.stop()


@schema.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, live_api):
    server, tokens, job_id = live_api
    if case.path_parameters and "job_id" in case.path_parameters:
        case.path_parameters["job_id"] = job_id  # unknown ids are all the same 404 (test_api_jobs)
    case.call_and_validate(
        base_url=server.url,
        headers={"Authorization": f"Bearer {tokens['admin']}"},
        checks=[not_a_server_error],
    )
