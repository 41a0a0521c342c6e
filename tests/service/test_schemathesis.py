"""Property-based fuzzing of the OpenAPI schema (Schemathesis) against a live API: no generated
request, valid or not, gets a 5xx, and nothing a client can write makes a later read fail.

Authenticated as a client is: a real tenant token (not admin) on every /v1 operation, and on the
internal telemetry operation the credential it accepts (an admin token; a job token would do
the same). Two runs:
- per operation, every operation including the internal one, 40 generated examples each plus
  the coverage phase, against one real job so per-job operations get past the 404;
- the telemetry operation alone, 300 valid batches, each followed by reads of the job;
- stateful (test_schemathesis_stateful.py, its own API): the schema's links chain a created job
  into the other operations.
After every accepted telemetry batch, a check reads the job back (events, metrics, checkpoints,
the job): the sequence that found "a batch breaks the job's events for good".

The operations are collected from the app's schema at import (Schemathesis' lazy fixture loader
does not run on this pytest); the test first checks that the live server serves that very
schema, then fuzzes the live server."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from engine.launcher import free_port
from service.app import create_app
from service.launcher import LaunchStatus
from service.settings import Settings
from tests.service.conftest import ApiServer, make_settings, make_tokens
from tests.service.launchers import FakeLauncher
from tests.waiting import wait_for


class FinishingLauncher(FakeLauncher):
    """Every launch succeeds at once, so a followed log of any job the fuzzer creates ends."""

    def submit(self, job_id, spec_json, env, *, submission_id=None):
        sid = super().submit(job_id, spec_json, env, submission_id=submission_id)
        self.set_status(sid, LaunchStatus.SUCCEEDED)
        return sid


OPENAPI = create_app(Settings(database_url="sqlite://"), launcher=FakeLauncher()).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)
TELEMETRY_PATH = "/v1/internal/jobs/{job_id}/telemetry"
# The one write a client's data flows through into every later read: many valid batches.
telemetry_schema = schemathesis.openapi.from_dict(OPENAPI).include(path=TELEMETRY_PATH)
telemetry_schema.config.generation.update(modes=[GenerationMode.POSITIVE])
READS = ("", "/events", "/metrics", "/checkpoints")


@pytest.fixture(scope="module")
def live_api(tmp_path_factory):
    port, launcher = free_port(), FinishingLauncher()
    config = make_settings(
        tmp_path_factory.mktemp("fuzz"), None, port, submit_rate_per_minute=60000.0, submit_burst=10000
    )
    tokens = make_tokens(config)
    server = ApiServer(config, launcher, port).start()
    assert httpx.get(f"{server.url}/openapi.json").json() == OPENAPI
    # One real job of the tenant, so per-job operations get past the 404 and into their own parameters.
    user = {"Authorization": f"Bearer {tokens['alice']}"}
    job_id = httpx.post(f"{server.url}/v1/jobs", json={"name": "fuzz"}, headers=user).json()["id"]
    record = {"iteration": 1, "loss": 1.0, "tokens": 8, "step_time_s": 0.1}
    admin = {"Authorization": f"Bearer {tokens['admin']}"}
    httpx.post(f"{server.url}/v1/internal/jobs/{job_id}/telemetry", json={"records": [record]}, headers=admin)
    wait_for(lambda: httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=user).json()["state"] == "succeeded")
    yield server, tokens, job_id
    server.stop()


def auth_for(path: str, tokens: dict[str, str]) -> dict[str, str]:
    """The tenant's token everywhere; on the telemetry operation the admin token it accepts."""
    who = "admin" if path == TELEMETRY_PATH else "alice"
    return {"Authorization": f"Bearer {tokens[who]}"}


def make_reads_still_work(server_url: str, tokens: dict[str, str]):
    """A check: after a telemetry batch is accepted, every read of that job still answers (a
    record a client can write must never make the job's record unreadable)."""

    def reads_still_work(ctx, response, case) -> None:
        if case.path != TELEMETRY_PATH or response.status_code >= 300:
            return
        job_id = case.path_parameters["job_id"]
        headers = {"Authorization": f"Bearer {tokens['admin']}"}
        for read in READS:
            r = httpx.get(f"{server_url}/v1/jobs/{job_id}{read}", headers=headers, timeout=60)
            assert r.status_code < 500, f"GET /v1/jobs/{job_id}{read} -> {r.status_code} after {case.body!r}"

    return reads_still_work


def test_every_operation_is_in_the_fuzzed_schema():
    """Nothing is left out of the fuzzing (the internal operation included)."""
    operations = {(path, method) for path, item in OPENAPI["paths"].items() for method in item}
    assert (TELEMETRY_PATH, "post") in operations and ("/v1/jobs", "post") in operations
    assert len(operations) >= 12
    links = OPENAPI["paths"]["/v1/jobs"]["post"]["responses"]["201"]["links"]
    linked = {link["operationId"] for link in links.values()}
    per_job = {
        item[method]["operationId"] for path, item in OPENAPI["paths"].items() if "{job_id}" in path for method in item
    }
    assert per_job <= linked, per_job - linked


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, live_api):
    """Over 30 s: 40 generated requests for every operation of the API over HTTP."""
    server, tokens, job_id = live_api
    if case.path_parameters and "job_id" in case.path_parameters:
        case.path_parameters["job_id"] = job_id  # unknown ids are all the same 404 (test_api_jobs)
    case.call_and_validate(
        base_url=server.url,
        headers=auth_for(case.path, tokens),
        checks=[not_a_server_error, make_reads_still_work(server.url, tokens)],
        timeout=60,
    )


@telemetry_schema.parametrize()
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_accepted_telemetry_breaks_a_read(case, live_api):
    """Over 30 s: 300 generated telemetry batches, each followed by every read of the job over HTTP."""
    server, tokens, job_id = live_api
    case.path_parameters["job_id"] = job_id
    case.call_and_validate(
        base_url=server.url,
        headers=auth_for(case.path, tokens),
        checks=[not_a_server_error, make_reads_still_work(server.url, tokens)],
        timeout=60,
    )
