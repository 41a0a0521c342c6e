"""Ray Train V2 (ray 2.60) pieces the driver plugs in: a TorchTrainer whose stop signal is ours,
an elastic scaling policy that only picks sizes the job can run on, and a worker callback that
stops rank 0 at a step boundary when Ray shuts a group down.

These lean on four private methods of Ray Train, and on classes Ray keeps in
`ray.train.v2._internal`. This is the one module of the project that may touch them
(tests/test_layering.py keeps everything outside workers/ off `ray.train.*._internal`), and
tests/workers/test_ray_internals.py fails, naming the installed Ray, when an upgrade moves one
or changes its signature, rather than a job failing (or quietly losing a stop signal):

- `DataParallelTrainer._initialize_and_run_controller(**kwargs)`: where the trainer hands the
  controller its scaling policy and its failure policy; we swap in `ElastronElasticPolicy` and
  wrap the failure policy in `RerunExitToDriver`.
- `DataParallelTrainer._register_sigint_handler(controller)`: Ray's handler aborts the run on
  SIGINT only (and calls `sys.exit` from a signal handler when the controller is gone); ours
  also takes SIGTERM (the default stop signal of Ray Jobs), records that a stop was asked, and
  leaves the exit to the driver.
- `DataParallelTrainer._create_default_callbacks()`: the controller's callbacks; ours drops
  the `DatasetsCallback` of a run without Ray datasets (its dataset manager is one more actor
  process per worker group start, each replica replacement included).
- `ElasticScalingPolicy._count_possible_workers(reserved)`: how many workers the cluster has
  room for; ours drops dead and excluded nodes and rounds down to a valid size.
- `ControllerCallback.after_controller_start(context)`: `AnnounceController` hands the job
  registry the controller of a replica group's run (resilience.resize: live), whose `abort` the
  driver calls (Ray's own abort handler is registered only from the main thread).
- `FailurePolicy.make_decision(error)` / `FailureDecision`: the controller's retry decision
  (`RerunExitToDriver` raises a rank's RerunExit to the driver).
- `ElasticScalingPolicy` and `WorkerCallback` themselves are imported from
  `ray.train.v2._internal` (Ray exports neither); the comment at each use says what public API
  would replace it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

import ray
from ray.train.torch import TorchTrainer

# Internal: Ray's public callback (`ray.train.UserCallback`) runs on the controller only; a public
# worker-side callback with a shutdown hook would replace this import. WorkerGroupCallback: a
# public "the worker group has started" hook on UserCallback would replace that one.
# ControllerCallback: a public handle on a running fit() (one that can abort it from any thread)
# would replace it.
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerCallback, WorkerGroupCallback

# Internal: a public failure-policy interface (or FailureConfig naming errors never to retry)
# would replace this import.
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy

# Internal: a public scaling-policy interface (or ScalingConfig taking the allowed worker counts
# and a node filter) would replace this import and the `_count_possible_workers` override.
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

log = logging.getLogger(__name__)


class ElastronElasticPolicy(ElasticScalingPolicy):
    """Ray's elastic policy, restricted to the sizes this job can run on (`valid_sizes`: the
    multiples of tensor x pipeline x context between min and max whose data-parallel size
    splits the global batch) and to live nodes outside `blocked_nodes` (excluded after a
    persistent error, or avoided to re-run a step on other hardware)."""

    def __init__(self, scaling_config, valid_sizes: list[int], blocked_nodes: set[str] | frozenset[str] = ()):
        super().__init__(scaling_config)
        self.valid_sizes = sorted(valid_sizes)
        self.blocked_nodes = set(blocked_nodes)

    # Private: what a public "allowed sizes" / "eligible nodes" option in ScalingConfig would do.
    def _count_possible_workers(self, reserved_resources) -> int:
        try:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - a GCS hiccup: trust the reservation as it is
            alive = set(reserved_resources)
        usable = {
            node: res
            for node, res in reserved_resources.items()
            if node in alive and node not in self.blocked_nodes
        }
        room = super()._count_possible_workers(usable)
        fits = [s for s in self.valid_sizes if s <= room]
        return fits[-1] if fits else 0


class RerunExitToDriver(FailurePolicy):
    """Ray's failure policy, except that a rank's RerunExit (the rerun state machine's exit 16:
    run the step on other hardware, or 17: exclude a node) goes to the driver at once: only the
    driver can resume the job elsewhere or exclude a node (workers/policy.py). Under
    replace_replica Ray would otherwise restart the replicas where they were, within
    `max_failures`: every replica exits together (the decision is agreed over them), and on the
    same nodes the resumed rerun exits 16 again at once (measured: four restarts of ~7 s spent
    the job's whole max_restarts before the driver saw an exit 16)."""

    def __init__(self, inner: FailurePolicy):
        super().__init__(inner.failure_config)
        self.inner = inner

    def make_decision(self, training_failed_error) -> FailureDecision:
        from workers.policy import classify

        failures = getattr(training_failed_error, "worker_failures", None) or {}
        if any(cause.kind == "rerun" for cause in classify(failures)):
            return FailureDecision.RAISE
        return self.inner.make_decision(training_failed_error)


class ElastronTorchTrainer(TorchTrainer):
    """TorchTrainer with our scaling policy and our stop signal handling.

    `on_stop()` is called (once) on the first SIGINT or SIGTERM during fit(); the run is then
    aborted through the controller (Ray Train's graceful path: workers get their shutdown
    callbacks, the placement group is removed) and fit() raises or returns; the driver reads
    its own stop flag to tell a cancel from a failure."""

    def __init__(
        self,
        *args,
        elastic_sizes: list[int] | None = None,
        blocked_nodes: set[str] | None = None,
        on_stop: Callable[[], None] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self._elastic_sizes = elastic_sizes
        self._blocked_nodes = set(blocked_nodes or ())
        self._on_stop = on_stop

    # Private: a public `scaling_policy=` argument to the trainer (or ScalingConfig) would
    # replace this override.
    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if self.scaling_config.elasticity_enabled and self._elastic_sizes:
            controller_init_kwargs["scaling_policy"] = ElastronElasticPolicy(
                self.scaling_config, self._elastic_sizes, self._blocked_nodes
            )
        controller_init_kwargs["failure_policy"] = RerunExitToDriver(controller_init_kwargs["failure_policy"])
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    # Private: Ray Train gives every run a DatasetsCallback, whose dataset manager is one more
    # actor process per worker group start, and so per replica replacement, even when the run has
    # no Ray datasets (ours read their own data): 1.3-1.8 s of CPU each (the job's setup hook
    # imports torch there), spent beside the survivors' steps (bench/recovery.py survive's
    # `cpu_cores`). A Ray that skipped it without datasets would make this override moot.
    def _create_default_callbacks(self):
        from ray.train.v2._internal.callbacks import DatasetsCallback

        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]

    # Private: a public way to abort a running fit() from the driver (e.g. a run handle with
    # abort(), or configurable stop signals) would let the driver install its own handlers; the
    # `controller.abort` below is the internal TrainController actor's method.
    def _register_sigint_handler(self, controller) -> None:
        stopping = threading.Event()

        def handler(signum, frame):
            if stopping.is_set():
                return  # one abort is enough; the driver exits when fit() ends
            stopping.set()
            log.info("elastron: %s received, aborting the run", signal.Signals(signum).name)
            if self._on_stop is not None:
                self._on_stop()
            try:
                ray.get(controller.abort.remote())
            except ray.exceptions.RayActorError:
                pass  # the controller exits as it aborts

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


class AnnounceController(ControllerCallback):
    """Runs in the controller of a replica group's run (resilience.resize: live,
    workers/replica_fits.py): hands the job registry this controller's handle for the slot, so
    that the driver can abort the run. Ray Train registers its own abort (the SIGINT handler)
    only when fit() runs in the main thread, and each of these runs in a thread of the driver."""

    def __init__(self, job_id: str, slot: int):
        self.job_id, self.slot = job_id, slot

    def after_controller_start(self, train_run_context) -> None:
        from workers.registry import NAMESPACE, registry_name

        registry = ray.get_actor(registry_name(self.job_id), namespace=NAMESPACE)
        registry.controller_started.remote(self.slot, ray.get_runtime_context().current_actor)


def controller_actor_runtime_env() -> str:
    """The serialized runtime environment of the controller actor a TorchTrainer.fit() in this
    process starts now (and of the helper actors it starts, which inherit it): Ray Train gives it
    `{"env_vars": <Ray Train's variables set in this process>}` with the blocking-get warning's
    default (DataParallelTrainer._initialize_and_run_controller), merged into this process's job
    environment."""
    # Internal: Ray Train's list of variables it passes on and the controller's default; a public
    # "the controller's runtime environment" would replace both.
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.constants import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        get_env_vars_to_propagate,
    )

    from workers.warm_processes import actor_runtime_env

    controller_vars = get_env_vars_to_propagate()
    controller_vars.setdefault(
        RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
    )
    job_env = ray._private.worker.global_worker.core_worker.get_current_runtime_env()
    return actor_runtime_env(job_env, {"env_vars": controller_vars})


def rank_actor_runtime_env(worker_runtime_env: dict) -> str:
    """The serialized runtime environment Ray Train's worker actors will get from a controller
    this process starts now with `RunConfig(worker_runtime_env=...)`: what the driver names when
    it asks for the ranks' processes ahead (workers/warm_processes.py, `prestart_for_launch`).

    Ray Train builds it in two steps, mirrored here: the controller's (controller_actor_runtime_env),
    then each worker actor's, the worker environment with the same variables
    (WorkerGroup._get_worker_runtime_env, a private static method) merged into the controller's.
    tests/workers/test_warm_processes.py runs a job on the result."""
    # Internal: Ray Train's worker environment builder.
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    from workers.warm_processes import actor_runtime_env

    return actor_runtime_env(controller_actor_runtime_env(), WorkerGroup._get_worker_runtime_env(worker_runtime_env))


class GracefulShutdown(WorkerCallback):
    """Runs in each worker when Ray Train shuts the group down (a resize, a cancel, the end of a
    failed attempt): rank 0 stops at the next step boundary with its telemetry delivered, and a
    checkpoint being written gets the rest of Ray's shutdown patience to commit (one that needs
    longer is abandoned: without its manifest no resume ever picks it up). See
    workers.rank.on_worker_shutdown."""

    def before_worker_shutdown(self) -> None:
        from workers.rank import on_worker_shutdown

        on_worker_shutdown()


class WarmControllerProcesses(WorkerGroupCallback):
    """Runs in the controller: once a worker group has been up for `delay_s`, asks the
    controller's raylet for `count` idle processes with the controller's job and environment,
    which the next attempt's controller and the first helper actors it starts then start in
    instead of fresh ones. See workers/warm_processes.py."""

    # Of the five processes Ray Train 2.60 starts per attempt on the controller's side, the three
    # the ranks wait for: the controller, its synchronization actor and its placement-group
    # cleaner (the ranks' train function runs only after the cleaner registered the group). The
    # dataset manager and the preemption watcher start while the ranks already train; warming
    # them too cost two more torch imports per attempt for nothing on the critical path.
    PROCESSES_PER_ATTEMPT = 3

    def __init__(self, count: int = PROCESSES_PER_ATTEMPT, delay_s: float = 3.0):
        self.count = count
        self.delay_s = delay_s
        self._prestarted = False

    def after_worker_group_start(self, worker_group) -> None:
        if self._prestarted:  # one set per controller, not one per resize
            return
        self._prestarted = True
        from workers.warm_processes import prestart_later

        prestart_later(self.count, self.delay_s)


def _set_env(name: str, value: str) -> None:
    os.environ[name] = value


class _LighthouseActor:
    """The job's Lighthouse with its liveness relay (engine/fault_tolerance/lighthouse.py), as a Ray
    actor: Ray's own LighthouseServerActor hosts torchft's server alone."""

    def __init__(self, lighthouse_kwargs: dict):
        from engine.fault_tolerance.lighthouse import Lighthouse

        self.lighthouse = Lighthouse(**lighthouse_kwargs)

    def address(self) -> str:
        return self.lighthouse.address()

    def liveness_address(self) -> str:
        return self.lighthouse.liveness_address()


def start_lighthouse(lighthouse_kwargs: dict):
    """The job's Lighthouse actor on this (the driver's or the controller's) node, asking for no
    CPU, so that it fits on a head node without CPUs."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return (
        ray.remote(num_cpus=0, max_restarts=0)(_LighthouseActor)
        .options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        )
        .remote(lighthouse_kwargs)
    )


def torchft_config(timeout_s: int, heartbeat_timeout_ms: int = 500, relay: bool = True):
    """Ray Train's TorchftConfig for `resilience.on_rank_failure: replace_replica`: one torch
    process group per replica group (Ray 2.60: one worker each), the controller replacing only a
    failed replica group, and the Lighthouse in an actor (engine/fault_tolerance/replica_quorum.py
    is the replicas' side). Our backend differs from Ray's in two things: the Lighthouse actor asks
    for no CPU, so it fits on a head node without CPUs (as the driver and the controller do), and
    it is ours: torchft's Lighthouse with the liveness relay, whose address every worker gets in
    LIVENESS_ENV beside torchft's TORCHFT_LIGHTHOUSE.

    `heartbeat_timeout_ms`: a replica whose host goes silent this long is out of the next quorum;
    one whose process dies is out within the relay's RELAY_TIMEOUT_MS.
    `relay`: False is torchft's Lighthouse alone (a dead process is out after
    `heartbeat_timeout_ms` too), for bench/recovery.py's same-run comparison."""
    # Internal: Ray exports TorchftConfig (ray.train.v2.torch) but not its backend; a public
    # "lighthouse actor" argument would replace this subclass.
    from ray.train.v2.torch.torchft_config import TorchftConfig, _TorchftBackend

    from workers.replicas import LIVENESS_ENV

    class _Backend(_TorchftBackend):
        def _maybe_create_lighthouse_actor(self, backend_config) -> str:
            if self.lighthouse_actor is not None:
                try:
                    return ray.get(self.lighthouse_actor.address.remote())
                except ray.exceptions.RayActorError:
                    # It died (its process killed, the OOM killer). Ray's backend keeps asking the
                    # dead actor at every start, each start fails, and the failed starts left the
                    # controller waiting for a placement group forever. A new Lighthouse instead:
                    # the replicas linked to the old one have failed on its close
                    # (replica_quorum.py), or at their quorum timeout without the relay.
                    pass
            self.lighthouse_actor = start_lighthouse(backend_config.lighthouse_kwargs)
            return ray.get(self.lighthouse_actor.address.remote())

        def on_start(self, worker_group, backend_config):
            self._maybe_create_lighthouse_actor(backend_config)
            liveness = ray.get(self.lighthouse_actor.liveness_address.remote())
            worker_group.execute(_set_env, LIVENESS_ENV, liveness)  # empty: no relay to link to
            super().on_start(worker_group, backend_config)

    class ElastronTorchftConfig(TorchftConfig):
        @property
        def backend_cls(self):
            return _Backend

    return ElastronTorchftConfig(
        lighthouse_kwargs={"silent_timeout_ms": heartbeat_timeout_ms, "relay": relay},
        timeout_s=timeout_s,
    )
