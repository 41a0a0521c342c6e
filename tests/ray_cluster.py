"""One Ray cluster for the whole pytest session, and a guard that fails a test which leaves work
on it behind.

The cluster is `ray.cluster_utils.Cluster`: a head without CPUs (drivers, Ray Train controllers,
job registries) and two one-CPU worker nodes, so a 2-rank job spans two Ray nodes and a node can
be removed and added back. Starting it (three raylets, the GCS, the dashboard and its agents)
costs ~10 s on a 2-core machine, so every Ray test in tests/workers uses this one. A test that
must own its cluster says so (tests/e2e: `elastron up` starts one as users do; the recovery
bench's smoke run starts its own: on this cluster after the workers tests its kill did not land).
Ray's temp folder (and with it the `ray_current_cluster` file that Ray's State API
and Ray Train's placement-group cleaner use to find "the" cluster) is private: several Ray
clusters on one machine (other test runs, a developer's `ray start`) must not see each other.

A shared cluster is only as good as its clean-up: a test that leaves an actor, a placement group
or a running Ray job slows or breaks the tests after it in ways that are hard to trace back. So
every test that uses `ray_cluster` is checked when it ends (`leftovers`): what it started must be
gone within LEAK_GRACE_S (Ray tears down a finished run's actors asynchronously), or the test
fails naming what it left, and the leftovers are removed so the next test starts clean. The
same holds for the cluster's shape: a test that removes a worker node must add one back (a test
that fails half-way does not), so the guard puts the two one-CPU worker nodes back and fails a
test that changed their number; one failed node test no longer fails every Ray test after it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from engine.launcher import free_port
from tests.environ import environment
from tests.tools import require_module

# Fewer processes per fit() on a 2-core machine: no preemption watcher actor (nothing is ever
# preempted here) and no Ray Train metrics; a faster controller poll.
RAY_TEST_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    # Each node's dashboard agent publishes its physical stats (psutil over every process) every
    # 5 s by default; nothing here reads them (the service reads nodes from the GCS's State API).
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    # Ray Jobs: stop a job with SIGINT (Ray Train's graceful abort) and give it time to finish
    # (the default 3 s before SIGKILL is shorter than an abort).
    "RAY_JOB_STOP_SIGNAL": "SIGINT",
    "RAY_JOB_STOP_WAIT_TIME_S": "60",
}

# The shared cluster's worker nodes: what every Ray test may count on when it starts.
WORKER_NODES = 2
# No log monitor: it tails every worker's log file for drivers that print them, and over a
# session of some 500 worker processes it used 39 CPU-s of the workers tests' ~1,600; the tests
# read the ranks through telemetry and the drivers' own output through Ray Jobs, neither of which
# goes through it.
NODE_ARGS = {"include_log_monitor": False}
WORKER_NODE_ARGS = {"num_cpus": 1, **NODE_ARGS}
# How long a test's actors, placement groups and Ray jobs may take to go after it ends.
LEAK_GRACE_S = 30.0
# Detached singletons Ray itself keeps for the cluster's life once something first needs them
# (Ray Data/Train's autoscaling coordinator): the cluster's, not a test's.
CLUSTER_SINGLETONS = frozenset({"_AutoscalingCoordinatorActor"})
LIVE_JOB_STATES = frozenset({"PENDING", "RUNNING"})


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
        head = {"num_cpus": 0, "include_dashboard": True, "dashboard_port": free_port(), **NODE_ARGS}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            for _ in range(WORKER_NODES):
                cluster.add_node(**WORKER_NODE_ARGS)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            with environment(RAY_ADDRESS=cluster.address):
                yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def worker_nodes(cluster) -> list:
    return [n for n in cluster.list_all_nodes() if n is not cluster.head_node]


@dataclass
class Leftovers:
    """What is alive on the cluster: actors (id -> (class, pid)), placement groups (ids), Ray
    jobs (submission id -> status)."""

    actors: dict[str, tuple[str, int]] = field(default_factory=dict)
    placement_groups: set[str] = field(default_factory=set)
    jobs: dict[str, str] = field(default_factory=dict)

    def since(self, before: Leftovers) -> Leftovers:
        return Leftovers(
            {
                a: c
                for a, c in self.actors.items()
                if a not in before.actors and c[0] not in CLUSTER_SINGLETONS
            },
            self.placement_groups - before.placement_groups,
            {j: s for j, s in self.jobs.items() if j not in before.jobs},
        )

    def __bool__(self) -> bool:
        return bool(self.actors or self.placement_groups or self.jobs)

    def describe(self) -> str:
        parts = [
            *(f"actor {cls} (pid {pid})" for cls, pid in sorted(self.actors.values())),
            *(f"placement group {pg[:12]}" for pg in sorted(self.placement_groups)),
            *(f"Ray job {job} ({status})" for job, status in sorted(self.jobs.items())),
        ]
        return ", ".join(parts)


def _job_client(cluster):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(f"http://{cluster.webui_url}")


def leftovers(cluster) -> Leftovers:
    """Every live actor, placement group and running or pending Ray job on `cluster`."""
    import ray
    from ray.util.state import list_actors

    actors = {
        a.actor_id: (a.class_name, a.pid or 0)
        for a in list_actors(filters=[("state", "!=", "DEAD")], limit=10_000, raise_on_missing_output=False)
    }
    groups = {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}
    jobs = {
        j.submission_id: str(j.status)
        for j in _job_client(cluster).list_jobs()
        if j.submission_id and str(j.status) in LIVE_JOB_STATES
    }
    return Leftovers(actors, groups, jobs)


def left_behind(cluster, before: Leftovers, grace_s: float = LEAK_GRACE_S) -> Leftovers:
    """What appeared on `cluster` since `before` and is still there after `grace_s`."""
    deadline = time.monotonic() + grace_s
    while True:
        left = leftovers(cluster).since(before)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def remove(cluster, left: Leftovers) -> None:
    """Kill what a test left, so the tests after it start on a clean cluster."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    client = _job_client(cluster)
    for job in left.jobs:
        with contextlib.suppress(Exception):
            client.stop_job(job)
    for _, pid in left.actors.values():  # every node of the test cluster is on this machine
        if pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    for pg in left.placement_groups:
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg))))


def restore_worker_nodes(cluster) -> int:
    """Put the cluster back to WORKER_NODES worker nodes; returns how many were missing (negative:
    how many were added beyond them)."""
    nodes = worker_nodes(cluster)
    missing = WORKER_NODES - len(nodes)
    for _ in range(missing):
        cluster.add_node(**WORKER_NODE_ARGS)
    for extra in nodes[WORKER_NODES:]:
        cluster.remove_node(extra)
    if missing:
        cluster.wait_for_nodes()
    return missing


@pytest.fixture(autouse=True)
def ray_leak_guard(request):
    """Fails a test that uses `ray_cluster` and leaves an actor, placement group or Ray job, or
    a different number of worker nodes than it found."""
    if "ray_cluster" not in request.fixturenames:
        yield
        return
    cluster = request.getfixturevalue("ray_cluster")
    before = leftovers(cluster)
    yield
    left = left_behind(cluster, before)
    if left:
        remove(cluster, left)
    missing = restore_worker_nodes(cluster)
    problems = [left.describe()] if left else []
    if missing:
        problems.append(f"{WORKER_NODES - missing} worker nodes instead of {WORKER_NODES} (put back)")
    if problems:
        pytest.fail(f"{request.node.nodeid} left on the shared Ray cluster: {'; '.join(problems)}", pytrace=False)
