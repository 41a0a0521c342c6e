"""Fixtures for the Ray tests: one Ray cluster for all of them, a telemetry receiver (the control
plane's side of the wire), and the small job every test trains.

The cluster is `ray.cluster_utils.Cluster`: a head without CPUs (drivers, Ray Train controllers,
job registries) and two one-CPU worker nodes, so a 2-rank job spans two Ray nodes and a node can
be removed and added back. Starting it is the most expensive step of these tests on a 2-core
machine, so every test module shares it; the elastic test, which removes a node, adds one back.
Ray's temp folder (and with it the `ray_current_cluster` file that Ray's State API and Ray Train's
placement-group cleaner use to find "the" cluster) is private: several Ray clusters on one
machine (other test runs, a developer's `ray start`) must not see each other.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from engine.launcher import free_port
from tests.environ import environment
from tests.tiny_jobs import TINY_LLAMA
from tests.tools import require_module
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

# Fewer processes per fit() on a 2-core machine: no preemption watcher actor (nothing is ever
# preempted here) and no Ray Train metrics; a faster controller poll.
RAY_TEST_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    # Ray Jobs: stop a job with SIGINT (Ray Train's graceful abort) and give it time to finish
    # (the default 3 s before SIGKILL is shorter than an abort).
    "RAY_JOB_STOP_SIGNAL": "SIGINT",
    "RAY_JOB_STOP_WAIT_TIME_S": "60",
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


@contextlib.contextmanager
def private_ray_env(tmp_root) -> Iterator[str]:
    """RAY_TMPDIR of our own (short: Ray's socket paths have a length limit) + test settings.

    The cluster runs without token auth, whatever earlier tests in this process did: they may
    have left RAY_AUTH_MODE=token in os.environ (the cluster's processes would inherit it and
    refuse this process) or in Ray's per-process auth state (RayConfig and the token cache, read
    when a client first talked to a token-auth head; then this process' own gRPC server refuses
    the cluster's workers, and actors die "before they started running"). So the variables are
    unset and that state re-read from the environment, as Ray's own tests do between clusters."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    ray_tmp = tempfile.mkdtemp(prefix="elr-", dir="/tmp")
    spool = str(tmp_root / "spool")
    no_auth = dict.fromkeys(("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"))
    try:
        with environment(RAY_TMPDIR=ray_tmp, ELASTRON_SPOOL_DIR=spool, **no_auth, **RAY_TEST_ENV):
            reset_auth_token_state()
            yield ray_tmp
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """The shared cluster (this process is connected to it; RAY_ADDRESS names it for others)."""
    ray = require_module("ray", "ray (a main dependency) is not installed")
    from ray.cluster_utils import Cluster

    with private_ray_env(tmp_path_factory.mktemp("ray")):
        # The dashboard on a free port: Ray's fixed 8265 fails the whole fixture while another
        # run on this machine (a second checkout's tests, a bench) holds it.
        head = {"num_cpus": 0, "include_dashboard": True, "dashboard_port": free_port()}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            for _ in range(2):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            with environment(RAY_ADDRESS=cluster.address):
                yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def worker_nodes(cluster) -> list:
    return [n for n in cluster.list_all_nodes() if n is not cluster.head_node]


@pytest.fixture(scope="session")
def telemetry() -> Iterator[TelemetryServer]:
    """The control plane's receiving end, with ELASTRON_API_URL/TOKEN pointing at it."""
    server = TelemetryServer().start()
    with environment(ELASTRON_API_URL=server.api_url, ELASTRON_API_TOKEN=server.token):
        yield server
    server.stop()
