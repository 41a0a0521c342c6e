"""Stateful fuzzing (Schemathesis) of a live API: the schema's links (POST /v1/jobs -> the job's
sub-resources and its telemetry) chain a created job into the other operations, so a telemetry
batch is followed by reads of the same job. Runs in its own module with its own API so the
per-operation run's thousands of jobs do not shape it (and Hypothesis sees the same state for
the same seed).

Positive data only, with our credentials: valid submissions create jobs, so sequences reach a
job's telemetry and its reads; invalid input is test_schemathesis.py's job.

Hypothesis replays sequences and needs the same answers each time: the API runs without its
reconciler (nothing changes a job behind the sequence's back: a queued job's cancel is always
200, never a timing-dependent 202), and logs are read without `follow` (a job that is never
launched would keep a followed log open for good)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from engine.launcher import free_port
from tests.service.conftest import ApiServer, make_settings, make_tokens
from tests.service.test_schemathesis import OPENAPI, FinishingLauncher, auth_for, make_reads_still_work

stateful_schema = schemathesis.openapi.from_dict(OPENAPI)
stateful_schema.config.generation.update(modes=[GenerationMode.POSITIVE], with_security_parameters=False)


@pytest.fixture(scope="module")
def live_api(tmp_path_factory):
    port = free_port()
    config = make_settings(
        tmp_path_factory.mktemp("stateful"), None, port, submit_rate_per_minute=60000.0, submit_burst=10000
    )
    tokens = make_tokens(config)
    server = ApiServer(config, FinishingLauncher(), port, reconcile=False).start()
    yield server, tokens
    server.stop()


def test_stateful_sequences_never_break_a_job(live_api):
    server, tokens = live_api
    base = stateful_schema.as_state_machine()
    reads_still_work = make_reads_still_work(server.url, tokens)

    class Machine(base):
        def before_call(self, case):
            if case.query:
                case.query.pop("follow", None)

        def get_call_kwargs(self, case):
            return {"base_url": server.url, "headers": auth_for(case.path, tokens), "timeout": 60}

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            case.validate_response(response, checks=[not_a_server_error, reads_still_work])

    Machine.run(
        settings=settings(
            max_examples=100,
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
    )
