"""Helpers shared by the Ray test modules: run a job, read what it sent, check what it left."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from engine.jobspec import parse_job
from engine.rerun.state_machine import Diagnosis, ErrorInjector
from tests.ray_cluster import leftovers
from tests.workers.telemetry_server import TelemetryServer
from workers.driver import JobResult, WorkerRunOptions, run_job

ROOT = Path(__file__).resolve().parents[2]
ELASTRON = [sys.executable, "-m", "elastron.cli"]


def run(job_id: str, spec: dict, storage: Path) -> JobResult:
    """The driver in this process, as `elastron worker-run` runs it."""
    options = WorkerRunOptions(storage_path=str(storage), flush_interval_s=0.1, quiet=True)
    return run_job(job_id, parse_job(spec), options)


def kinds(server: TelemetryServer, job_id: str, source: str = "driver") -> list[str]:
    return [e["kind"] for e in server.events(job_id) if e.get("source") == source]


def elastron_train(spec: dict, workdir: Path) -> list[dict]:
    """`elastron train` on the same spec (local processes, no Ray): its metrics records."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    metrics = workdir / "metrics.jsonl"
    proc = subprocess.run(
        [*ELASTRON, "train", str(path), "--quiet", "--metrics-out", str(metrics)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "ELASTRON_NODE_ID": "reference"},
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def ray_train_leftovers(cluster) -> dict[str, list]:
    """Ray Train's actors and the placement groups still alive on `cluster` (the whole cluster,
    not only what this test started: tests/ray_cluster.py's guard checks that after each test)."""
    left = leftovers(cluster)
    train_actors = ("RayTrainWorker", "TrainController", "JobRegistry", "PlacementGroupCleaner")
    return {
        "actors": sorted(cls for cls, _ in left.actors.values() if cls in train_actors),
        "placement_groups": sorted(left.placement_groups),
    }


def seed_with_one_early_injection(rate: int = 4, iterations: int = 8, only: bool = True) -> int:
    """A training seed whose injected fault first hits iteration 2 or 3 (fp32: two validations
    per iteration, the loss and the grad norm) and, with `only`, never again in the run (so the
    resumes after the diagnosis train on)."""
    horizon = 2 * (iterations + 1)
    for seed in range(5000):
        inj = ErrorInjector(rate, Diagnosis.PERSISTENT_ERROR, seed)
        hits = [d for d in range(1, horizon + 1) if inj.maybe_inject()]
        if hits and 2 < hits[0] <= 6 and (len(hits) == 1 or not only):
            return seed
    raise AssertionError("no seed found")


def _raylets(cluster, head: bool) -> dict[int, str]:
    """Raylet pid -> node id of the cluster's worker nodes (and its head with `head`)."""
    from ray._private import ray_constants

    from tests.ray_cluster import worker_nodes

    nodes = cluster.list_all_nodes() if head else worker_nodes(cluster)
    return {n.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid: n.node_id for n in nodes}


def _idle_children(raylets: dict[int, str]):
    """(pid, node id, /proc entry) of each idle Ray worker (`ray::IDLE`) of `raylets`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "cmdline").read_bytes().startswith(b"ray::IDLE"):
                continue
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent in raylets:
            yield int(entry.name), raylets[parent], entry


def end_idle_workers(cluster, within_s: float = 30.0) -> None:
    """SIGKILL every idle Ray worker of the cluster, head included, until a look finds none (a
    process an earlier test asked for may still be starting; `within_s` bounds the rounds): the
    shared cluster's Ray tests drive their jobs from this process, one Ray job, so a process a
    test's job started ahead (a warm one, or one asked for at a launch) could take a later
    test's rank or controller. For a test about which processes its own job's actors start in;
    such a test still checks its own premise (a process may start after the last look)."""
    import signal
    import time

    raylets = _raylets(cluster, head=True)
    deadline = time.monotonic() + within_s
    while (idle := [pid for pid, _, _ in _idle_children(raylets)]) and time.monotonic() < deadline:
        for pid in idle:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def warm_rank_processes(cluster, torch_loaded: bool = True) -> dict[str, list[int]]:
    """Per worker node, the idle processes a rank can start in: idle Ray workers (`ray::IDLE`)
    started with the ranks' environment (our preload hook and Ray Train's propagated variables
    in their environ), torch loaded (`torch_loaded=False`: also those still starting)."""
    from workers.warm_processes import SETUP_HOOK

    raylets = _raylets(cluster, head=False)
    found: dict[str, list[int]] = {node: [] for node in raylets.values()}
    for pid, node, entry in _idle_children(raylets):
        try:
            environ = (entry / "environ").read_bytes()
            ready = SETUP_HOOK.encode() in environ and b"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" in environ
            loaded = not torch_loaded or "libtorch_cpu" in (entry / "maps").read_text()
        except OSError:
            continue
        if ready and loaded:
            found[node].append(pid)
    return found
