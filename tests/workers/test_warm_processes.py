"""Warm processes for restarts (workers/warm_processes.py): the spec default, the hook, and, on
the shared Ray cluster, that a process prestarted by an actor takes the next actor with the same
job and environment with torch already imported (what makes a restart's ranks start in ~0.1 s)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import pytest

from tests.tools import require_module
from workers import warm_processes
from workers.rank import process_started_at
from workers.warm_processes import process_was_warm


def test_the_job_spec_takes_warm_restart():
    from engine.jobspec import parse_job

    spec = {
        "model": {"arch": "llama", "num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 8},
        "training": {"global_batch_size": 2, "micro_batch_size": 1, "train_iters": 1},
        "resilience": {"warm_restart": True},
    }
    assert parse_job(spec).resilience.warm_restart is True
    spec["resilience"] = {"warm_restart": "sometimes"}
    with pytest.raises(Exception, match="warm_restart"):
        parse_job(spec)


def test_a_process_started_before_its_attempt_counts_as_warm():
    assert process_was_warm(100.0, 90.0) is True
    assert process_was_warm(100.0, 101.0) is False
    assert process_was_warm(None, 90.0) is None


def test_preloading_never_fails_the_process(monkeypatch, caplog):
    monkeypatch.setattr(warm_processes, "PRELOAD_MODULES", ("json", "elastron_no_such_module"))
    with caplog.at_level(logging.WARNING, logger=warm_processes.__name__):
        warm_processes.preload()
    assert "elastron_no_such_module" in caplog.text


def test_the_controller_callback_prestarts_once_per_controller(monkeypatch):
    require_module("ray", "ray (a main dependency) is not installed")
    from workers.trainer import WarmControllerProcesses

    calls = []
    monkeypatch.setattr(warm_processes, "prestart_later", lambda count, delay_s: calls.append((count, delay_s)))
    callback = WarmControllerProcesses(count=5, delay_s=2.0)
    callback.after_worker_group_start(None)
    callback.after_worker_group_start(None)  # a resize starts another group in the same controller
    assert calls == [(5, 2.0)]


def _maps_torch(pid: int) -> bool:
    try:
        return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _hooked_workers() -> set[int]:
    """Ray worker processes started with the rank environment (the hook is in their environ)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if warm_processes.SETUP_HOOK.encode() in (entry / "environ").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                pass
    return found


def test_a_prestarted_process_takes_the_next_rank_actor_with_torch_imported(ray_cluster):
    """Over 30 s: two rank processes start on one 1-CPU node, each importing torch and the engine
    (the cold one, then the prestarted one the next actor must take), beside the shared
    cluster's daemons."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tests.ray_cluster import worker_nodes

    node_id = worker_nodes(ray_cluster)[0].node_id

    @ray.remote(num_cpus=0)
    class Probe:
        def info(self):
            return os.getpid(), "torch" in sys.modules, "engine.training" in sys.modules

        def prestart(self):
            return warm_processes.prestart_here(1)

    def probe():
        return Probe.options(
            runtime_env=warm_processes.rank_runtime_env(),
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote()

    first = probe()
    first_pid, torch_loaded, engine_loaded = ray.get(first.info.remote(), timeout=120)
    assert torch_loaded and engine_loaded, "the setup hook did not preload a cold rank process"
    before = _hooked_workers()
    assert ray.get(first.prestart.remote(), timeout=60) is True
    deadline = time.monotonic() + 120
    while not (new := {p for p in _hooked_workers() - before if _maps_torch(p)}):
        assert time.monotonic() < deadline, "the raylet started no process for the prestart request"
        time.sleep(0.2)
    time.sleep(1.0)  # the rest of its imports after torch
    created_at = time.time()
    second = probe()
    pid, torch_loaded, engine_loaded = ray.get(second.info.remote(), timeout=120)
    try:
        assert pid in new, f"the next actor started a fresh process {pid}, not the prestarted {sorted(new)}"
        assert process_started_at(pid) < created_at
        assert torch_loaded and engine_loaded
    finally:
        ray.kill(first)
        ray.kill(second)


def test_the_environment_named_for_an_actor_is_the_one_ray_gives_it(ray_cluster):
    """workers.warm_processes.actor_runtime_env against Ray itself: an actor with an environment
    of its own created by this process (whose environment is empty), and two created by that
    actor, one with an environment of its own (merged) and one without (inherited). The
    environments carry variables only: no hook, no imports, three light processes."""
    import ray

    from workers.warm_processes import actor_runtime_env

    parent_env = {"env_vars": {"ELASTRON_A": "1", "ELASTRON_B": "parent"}}
    child_env = {"env_vars": {"ELASTRON_B": "child", "ELASTRON_C": "x y"}}

    class Env:
        def env(self) -> str:
            return ray._private.worker.global_worker.core_worker.get_current_runtime_env()

    Child = ray.remote(num_cpus=0)(Env)

    @ray.remote(num_cpus=0)
    class Parent(Env):
        def children(self) -> tuple[str, str]:
            merged, inherited = Child.options(runtime_env=child_env).remote(), Child.remote()
            try:
                return ray.get([merged.env.remote(), inherited.env.remote()], timeout=120)
            finally:
                ray.kill(merged)
                ray.kill(inherited)

    here = ray._private.worker.global_worker.core_worker.get_current_runtime_env()
    parent = Parent.options(runtime_env=parent_env).remote()
    try:
        own = ray.get(parent.env.remote(), timeout=120)
        merged, inherited = ray.get(parent.children.remote(), timeout=120)
    finally:
        ray.kill(parent)
    assert own == actor_runtime_env(here, parent_env)
    assert merged == actor_runtime_env(own, child_env)
    assert inherited == actor_runtime_env(own, None) == own
    assert merged != actor_runtime_env(own, parent_env)  # the check can fail


def test_a_first_launch_starts_its_ranks_in_processes_asked_for_ahead(ray_cluster, telemetry, tmp_path):
    """A 2-rank job fills the shared cluster's two free CPUs, so the driver knows its nodes and
    asks them for the ranks' processes before it starts Ray Train's controller: both ranks run
    in processes older than the controller's (a process Ray starts for a rank starts after the
    controller, which asks for it), and none of those asked for is left idle (the environment
    the driver named is the ranks' own: with any other, Ray would start two more and leave the
    two asked for idle)."""
    import threading

    from ray.util.state import list_actors

    from tests.waiting import wait_for
    from tests.workers.conftest import job
    from tests.workers.ray_helpers import end_idle_workers, run, warm_rank_processes

    end_idle_workers(ray_cluster)  # a cold controller, and no rank process but those asked for
    job_id = "launch-warm"
    seen: dict = {}

    def controller_start() -> None:
        wait_for(lambda: telemetry.events(job_id, "ranks_started"), what="ranks started")
        (controller,) = list_actors(filters=[("class_name", "=", "TrainController"), ("state", "=", "ALIVE")])
        seen["controller"] = process_started_at(controller.pid)

    watcher = threading.Thread(target=controller_start, daemon=True)
    watcher.start()
    spec = job(checkpoint={"path": str(tmp_path / "ckpt")}, resilience={"warm_restart": False})
    result = run(job_id, spec, tmp_path / "runs")
    watcher.join(timeout=60)
    assert result.exit_code == 0, result.reason
    (started,) = telemetry.events(job_id, "ranks_started")
    ranks = {r["rank"]: r["process_started_at"] for r in started["ranks"]}
    assert seen.get("controller") is not None, "the controller's process was not seen"
    assert all(at < seen["controller"] for at in ranks.values()), (ranks, seen)
    assert not any(warm_rank_processes(ray_cluster, torch_loaded=False).values()), "a process asked for was left idle"
