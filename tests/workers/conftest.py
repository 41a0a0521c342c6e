"""Fixtures for the Ray tests: a telemetry receiver (the control plane's side of the wire) and
the small job every test trains. The cluster they share, and the guard that fails a test which
leaves work on it, are tests/ray_cluster.py's; a test
that removes a node adds one back.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest

from tests.environ import environment
from tests.tiny_jobs import TINY_LLAMA
from tests.workers.telemetry_server import TelemetryServer

# Small and quick: 2 layers, hidden 64, seq 32; 2 ranks of data parallelism.
JOB = {
    "name": "rayjob",
    "model": dict(TINY_LLAMA),
    "data": {"source": "text"},
    "training": {
        "global_batch_size": 4,
        "micro_batch_size": 2,
        "train_iters": 40,
        "seed": 7,
        "log_interval": 10,
    },
    "optimizer": {"lr": 2e-3, "lr_warmup_iters": 1},
    "checkpoint": {"interval": 5},
    "resources": {"ranks": 2, "device": "cpu"},
}


def job(**sections) -> dict:
    """JOB with some sections' fields replaced: job(training={"train_iters": 8})."""
    out = copy.deepcopy(JOB)
    for section, fields in sections.items():
        if isinstance(fields, dict):
            out.setdefault(section, {}).update(fields)
        else:
            out[section] = fields
    return out


@pytest.fixture(scope="session")
def telemetry() -> Iterator[TelemetryServer]:
    """The control plane's receiving end, with ELASTRON_API_URL/TOKEN pointing at it."""
    server = TelemetryServer().start()
    with environment(ELASTRON_API_URL=server.api_url, ELASTRON_API_TOKEN=server.token):
        yield server
    server.stop()
