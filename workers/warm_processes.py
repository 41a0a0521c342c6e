"""Warm processes for the next restart: Python workers started ahead on each node, with Ray,
torch and the engine already imported, that Ray hands to the next worker group's rank actors.

Why: Ray Train v2 replaces the whole worker group on any failure, and every new rank actor used
to be a fresh process: Python + Ray connect (~1.5 s), torch and Ray Train imports (~3 s on this
CPU) and the engine's imports (~1.5 s) — 6 of the ~8 s from SIGKILL to the first step again
(bench/recovery.py). Ray reuses an idle worker process for a new actor when the process has
never run anything else and was started with the same job and the same runtime environment
(the worker pool matches on the environment's hash). So:

1. The rank actors' runtime environment carries a worker-process setup hook (`preload`), which
   Ray runs in every process started with that environment — at its start, before any actor is
   placed in it. A cold rank process pays the imports there instead of in `rank_main`; a warm
   one has paid them while the job trained.
2. Once a rank has trained a step, it asks its node's raylet for one more idle process with
   its own job and runtime environment (`prestart_here`): the replacement for itself. The next
   group's rank actors on that node land in those processes in ~0.1 s.
3. The same for Ray Train's own side of an attempt: a new controller actor, which starts a
   placement-group cleaner, a synchronization actor, a dataset manager and a preemption
   watcher, each one more process (the cleaner is waited on before the ranks run). A callback
   in the controller (workers.trainer.WarmControllerProcesses) prestarts the three the ranks
   wait for, with the controller's environment, once the group is up. The driver connects with a job-level setup
   hook (`job_runtime_env`, Ray's public `worker_process_setup_hook`) so that those processes
   have Ray Train and torch imported too.

4. A job's first group (and a restart without warm processes) where the driver knows the nodes
   before Ray Train does (`prestart_for_launch`): the scheduler's placement, or a fixed-size
   group that fills every free slot of the cluster. The driver asks those raylets for the rank
   processes before it starts the controller, so the ranks' imports run beside the
   controller's own (~3 s here) instead of after them: a 2-rank job's ranks started 1.1-2.3 s
   sooner on this 2-core machine (bench/recovery.py's `launch` mode; workers/README.md).
   The driver must name the exact environment string the rank actors will get, which Ray
   builds from the controller's (`actor_runtime_env`; workers.trainer.rank_actor_runtime_env
   says what Ray Train puts in it); a wrong string costs the process and nothing else
   (tests/workers/test_warm_processes.py fails if the ranks stop landing in them).

Each warm process holds about 0.3 GB of host memory and nothing else (no GPU context, no
resources reserved). Ray ends them with the driver (they belong to its Ray job) or after
`KEEP_ALIVE_S` idle when the node runs more workers than it has CPUs.

Ray exposes neither piece publicly, so this module is the one place that leans on them, and
tests/workers/test_ray_internals.py pins each:
- the raylet's `PrestartWorkers` RPC (node_manager.proto: language, job_id, runtime_env_info,
  keep_alive_duration_secs, num_workers), reached with Ray's own authenticated channel;
- the worker's own raylet address (`global_worker.node`) and the core worker's serialized
  runtime environment (`get_current_runtime_env`): the exact
  string the raylet hashed when it placed this actor, job environment merged in — a dict
  serialised again by Python differs in whitespace, and the hash with it;
- the setup-hook variable `ray.init(runtime_env={"worker_process_setup_hook": ...})` sets for a
  job (Ray ignores the field on an actor's own runtime environment), written with Ray's helper.
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time

log = logging.getLogger(__name__)

SETUP_HOOK = "workers.warm_processes.preload"
JOB_SETUP_HOOK = "workers.warm_processes.preload_ray_train"
# What a rank imports before its first step (workers.rank.rank_main and Ray Train's worker).
# No module here may touch CUDA at import: Ray sets CUDA_VISIBLE_DEVICES when it places the
# actor, after this ran.
PRELOAD_MODULES = (
    "torch",
    "torch.distributed",
    "ray.train",
    "ray.train.torch",
    "engine.jobspec",
    "engine.train_loop",
    "engine.watchdog",
    "workers.rank",
    "workers.snapshots",
    "workers.telemetry",
)
# What Ray Train's controller and its helper actors import when they start (the controller
# unpickles TorchConfig and our callbacks, which import torch): 2.6 s of a warm controller's
# start here when its process had not imported them.
RAY_TRAIN_MODULES = ("torch", "ray.train.torch", "ray.train.v2.api.data_parallel_trainer", "workers.trainer")
# How long the raylet keeps an idle warm process that it would otherwise end (more workers on
# the node than CPUs).
KEEP_ALIVE_S = 24 * 3600
PRESTART_TIMEOUT_S = 10.0
# How long a process asked for at a launch stays when no rank takes it (the group was placed
# elsewhere): the group's start, generously.
LAUNCH_KEEP_ALIVE_S = 300


def _import_all(names: tuple[str, ...]) -> None:
    """Never raises: a module that fails to import here fails where it is used, with its own
    message."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the user's own import reports it
            log.warning("preloading %s failed; it is imported where it is used", name, exc_info=True)


def preload() -> None:
    """Ray's worker-process setup hook for rank processes."""
    _import_all(PRELOAD_MODULES)


def preload_ray_train() -> None:
    """The job-level setup hook (every other process of a fast-recovery job: Ray Train's
    controller and helpers, the registry, the snapshot holders)."""
    _import_all(RAY_TRAIN_MODULES)


def job_runtime_env() -> dict:
    """The driver's ray.init(runtime_env=...) for a job with warm restarts: Ray's public
    job-level setup hook, so a warm controller process has Ray Train and torch imported."""
    return {"worker_process_setup_hook": JOB_SETUP_HOOK}


def rank_runtime_env() -> dict:
    """The runtime environment for Ray Train's worker actors (RunConfig.worker_runtime_env)."""
    # Private: Ray's helper for a job-level string hook; the public field is a no-op on actors.
    from ray._private.runtime_env.setup_hook import export_setup_func_module

    return export_setup_func_module({}, SETUP_HOOK)


def no_preload_runtime_env() -> dict:
    """For the actors a rank starts (the snapshot holders): they inherit the rank's environment,
    so they would import torch and the engine for nothing, and could take a warm process a rank
    needs. An empty hook variable is no hook (Ray's worker skips it), and another hash."""
    from ray._private import ray_constants

    return {"env_vars": {ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR: ""}}


def prestart_here(count: int = 1, keep_alive_s: int = KEEP_ALIVE_S, spacing_s: float = 1.0) -> bool:
    """Ask this node's raylet to start `count` idle worker processes with the calling worker's
    job and runtime environment, one request every `spacing_s`: the raylet drops a request while
    as many processes are starting as the node has CPUs (maximum_startup_concurrency), which a
    small node hits at once. False (logged) when Ray refuses or the RPC moved."""
    for i in range(count):
        if i:
            time.sleep(spacing_s)
        if not _prestart_one(keep_alive_s):
            return False
    return True


def _prestart_one(keep_alive_s: int) -> bool:
    import ray

    worker = ray._private.worker.global_worker
    # This process's own raylet, without ray.nodes(): that lists the whole cluster, and every
    # rank of a large job would ask for it at each restart.
    raylet = f"{worker.node.node_ip_address}:{worker.node.node_manager_port}"
    env = worker.core_worker.get_current_runtime_env()
    return _prestart(raylet, env, 1, keep_alive_s, "the next restart")


def _prestart(raylet: str, serialized_env: str, count: int, keep_alive_s: int, why: str) -> bool:
    """Ask the raylet at `raylet` (host:port) for `count` idle processes of this process's Ray
    job with the runtime environment `serialized_env`. False (logged) when Ray refuses."""
    try:
        import ray
        from ray._private.grpc_utils import init_grpc_channel
        from ray._private.utils import get_runtime_env_info
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

        context = ray.get_runtime_context()
        info = get_runtime_env_info(context.runtime_env)
        info.serialized_runtime_env = serialized_env
        request = node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON,
            job_id=bytes.fromhex(context.get_job_id()),
            runtime_env_info=info,
            keep_alive_duration_secs=int(keep_alive_s),
            num_workers=count,
        )
        channel = init_grpc_channel(raylet)
        try:
            node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(
                request, timeout=PRESTART_TIMEOUT_S
            )
        finally:
            channel.close()
        return True
    except Exception:  # noqa: BLE001 - a warm process is an optimisation, never a failure
        log.warning("could not prestart a process for %s", why, exc_info=True)
        return False


def actor_runtime_env(parent: str, child: dict | None) -> str:
    """The serialized runtime environment of an actor created with `runtime_env=child` by a
    process whose own serialized environment is `parent`: the string its raylet hashes to pick a
    worker process for it. Ray's core worker keeps the child's string as Ray's Python wrote it
    when the parent's is empty, the parent's when the child's is, and otherwise merges the two
    (the child's keys win, `env_vars` merged key by key) and writes them as compact JSON with
    sorted keys (nlohmann's dump): one space differently and no process matches."""
    from ray.runtime_env import RuntimeEnv

    own = RuntimeEnv(**child).serialize() if child else ""
    if parent in ("", "{}"):
        return own or "{}"
    if not own:
        return parent
    merged = json.loads(parent)
    for key, value in json.loads(own).items():
        if key == "env_vars" and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return json.dumps(merged, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def raylets() -> dict[str, str]:
    """{Ray node id: its raylet's host:port} over the live nodes."""
    import ray

    return {n["NodeID"]: f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}" for n in ray.nodes() if n.get("Alive")}


def prestart_for_launch(nodes: dict[str, int], serialized_env: str) -> int:
    """Ask each node of `nodes` ({Ray node id: ranks}) for that many idle processes with the rank
    actors' environment `serialized_env`, for a group about to start there; returns how many
    were asked for. Not taken within LAUNCH_KEEP_ALIVE_S (the group went elsewhere), they end
    as any idle worker does; they end with the driver's Ray job in any case."""
    where = raylets()
    asked = 0
    for node, count in sorted(nodes.items()):
        if count <= 0 or node not in where:
            continue
        if _prestart(where[node], serialized_env, count, LAUNCH_KEEP_ALIVE_S, "a launch"):
            asked += count
    return asked


def prestart_on(nodes: dict[str, int], serialized_env: str, why: str, spacing_s: float = 1.0) -> threading.Thread:
    """In the background, ask each node of `nodes` ({Ray node id: processes}) for idle processes
    with `serialized_env` that stay until taken (KEEP_ALIVE_S), one request every `spacing_s`
    (see prestart_here): for a start that may come much later (a live resize's grow)."""

    def ask() -> None:
        where = raylets()
        first = True
        for node, count in sorted(nodes.items()):
            for _ in range(count if node in where else 0):
                if not first:
                    time.sleep(spacing_s)
                first = False
                _prestart(where[node], serialized_env, 1, KEEP_ALIVE_S, why)

    thread = threading.Thread(target=ask, name="elastron-warm-prestart", daemon=True)
    thread.start()
    return thread


def prestart_after_first_step(trainer, count: int = 1, poll_s: float = 0.2, give_up_s: float = 3600.0) -> threading.Thread:
    """Prestart once `trainer` has finished a step past where it started, so the new processes'
    imports do not compete with this group's setup and first step."""
    begin = trainer.iteration

    def wait_then_prestart() -> None:
        deadline = time.monotonic() + give_up_s
        while trainer.iteration <= begin and time.monotonic() < deadline:
            time.sleep(poll_s)
        if trainer.iteration > begin:
            prestart_here(count)

    thread = threading.Thread(target=wait_then_prestart, name="elastron-warm-prestart", daemon=True)
    thread.start()
    return thread


def prestart_later(count: int, delay_s: float) -> threading.Timer:
    """Prestart `count` processes like the caller's in `delay_s` (a daemon timer)."""
    timer = threading.Timer(delay_s, prestart_here, args=(count,))
    timer.daemon = True
    timer.start()
    return timer


def process_was_warm(attempt_started_at: float | None, process_started_at: float | None) -> bool | None:
    """Whether this rank runs in a process started before its attempt (a warm one)."""
    if attempt_started_at is None or process_started_at is None:
        return None
    return process_started_at < attempt_started_at
