"""A driver killed with SIGKILL while its job trains with in-memory snapshots leaves nothing
behind on the shared cluster (conftest.py): no snapshot holder actor (they are owned by the
driver's side, not detached) and no slot file in the nodes' RAM-backed directory (each holder's
watcher removes its node's files when the holder dies, SIGKILL included).

The driver runs as `elastron worker-run` in its own process, as Ray Jobs runs it: SIGKILL is
what Ray Jobs sends a driver that does not stop in time, and what an OOM killer sends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import ELASTRON, ROOT
from workers.snapshot_files import snapshot_dir
from workers.snapshots import holder_name


def _alive_actors(prefix: str = "", class_names: tuple[str, ...] = ("SnapshotHolder",)) -> list[str]:
    from ray.util.state import list_actors

    return [
        a.name
        for a in list_actors(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False, limit=1000)
        if a.class_name in class_names and (a.name or "").startswith(prefix)
    ]


def _slot_files(job_id: str) -> list[str]:
    """The job's slot files on this machine (the test cluster's nodes share its /dev/shm)."""
    return sorted(str(p) for p in snapshot_dir(job_id).rglob("*.snap"))


def test_a_sigkilled_driver_leaves_no_holder_and_no_snapshot_file(ray_cluster, telemetry, tmp_path):
    job_id = "driver-kill"
    spec = job(
        training={"train_iters": 100000, "log_interval": 1000},
        checkpoint={"path": str(tmp_path / "ckpt"), "interval": 1000, "local_interval": 1},
        resilience={"max_restarts": 0, "warm_restart": False},  # no warm processes: cheaper
    )
    prefix = holder_name(job_id, "")
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen(
        [*ELASTRON, "worker-run", job_id, "--storage", str(tmp_path / "runs"), "--quiet"],
        cwd=ROOT,
        env={**os.environ, "ELASTRON_JOB_SPEC": json.dumps(spec)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def training_with_snapshots() -> bool:
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()
            return (
                len(telemetry.records(job_id)) >= 3
                and len(_alive_actors(prefix)) == 2  # one holder per worker node
                and len(_slot_files(job_id)) >= 2  # each rank's slot files on its node
            )

        wait_for(training_with_snapshots, 180, "training with in-memory snapshots", interval_s=0.5)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)

        def nothing_left() -> bool:
            return not _alive_actors(prefix) and not snapshot_dir(job_id).exists()

        wait_for(nothing_left, 60, "the holders and their slot files to go", interval_s=0.5)
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()
    # The rest of the job went with its driver too (the next tests need the CPUs).
    wait_for(
        lambda: not _alive_actors(class_names=("RayTrainWorker", "TrainController", "JobRegistry")),
        60,
        "the job's other actors to go",
        interval_s=0.5,
    )
    _release_dead_runs_reservations()


def _release_dead_runs_reservations() -> None:
    """Ray Train's autoscaling coordinator (a detached actor) keeps a run's resource request for
    180 s after its controller dies without cancelling it (AUTOSCALING_REQUESTS_EXPIRE_TIME_S in
    ray/train/v2/_internal/execution/scaling_policy/autoscaling_coordinator_client.py): an
    elastic job started meanwhile sees no room (test_ray_elastic.py, next on the shared cluster).
    No other Ray Train run is alive now (the tests run one at a time), so cancel every Train
    request, as the dead controller would have."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    requesters = ray.get(coordinator.__ray_call__.remote(lambda self: list(self._ongoing_reqs)))
    for requester in requesters:
        if str(requester).startswith("train-"):
            ray.get(coordinator.cancel_request.remote(requester_id=requester))
