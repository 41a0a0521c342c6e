"""The Ray Train internals workers/trainer.py builds on (its docstring lists them), checked
without a cluster. A Ray upgrade that moves one or changes its signature fails here, naming the
installed Ray, and not in a job; worse than a job failing, a hook we override that Ray renamed
or stopped calling would fail nothing at all: Ray would just no longer call ours (no SIGTERM
handling, no elastic sizes, no graceful worker shutdown).

This file and workers/trainer.py are the only places allowed to touch `ray.train.v2._internal`
(tests/test_layering.py)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import ray

RAY = f"Ray {ray.__version__}"

DATA_PARALLEL_TRAINER = ("ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer")
ELASTIC_POLICY = ("ray.train.v2._internal.execution.scaling_policy", "ElasticScalingPolicy")
WORKER_CALLBACK = ("ray.train.v2._internal.execution.callback", "WorkerCallback")
TRAIN_CONTROLLER = ("ray.train.v2._internal.execution.controller", "TrainController")
RAY_WORKER = ("ray.train.v2._internal.execution.worker_group.worker", "RayTrainWorker")
WORKER_GROUP_CALLBACK = ("ray.train.v2._internal.execution.callback", "WorkerGroupCallback")
WORKER_GROUP = ("ray.train.v2._internal.execution.worker_group.worker_group", "WorkerGroup")
FAILURE_POLICY = ("ray.train.v2._internal.execution.failure_handling", "FailurePolicy")
CONTROLLER_CALLBACK = ("ray.train.v2._internal.execution.callback", "ControllerCallback")

# (Ray's class, its method, the parameters workers/trainer.py overrides or calls it with, our
# class that overrides it). "**" is any **kwargs: its name does not matter to a caller.
METHODS = [
    (DATA_PARALLEL_TRAINER, "_initialize_and_run_controller", ["self", "**"], "ElastronTorchTrainer"),
    (DATA_PARALLEL_TRAINER, "_register_sigint_handler", ["self", "controller"], "ElastronTorchTrainer"),
    (DATA_PARALLEL_TRAINER, "_create_default_callbacks", ["self"], "ElastronTorchTrainer"),
    (ELASTIC_POLICY, "_count_possible_workers", ["self", "reserved_resources"], "ElastronElasticPolicy"),
    (ELASTIC_POLICY, "__init__", ["self", "scaling_config"], None),  # super().__init__(scaling_config)
    (WORKER_CALLBACK, "before_worker_shutdown", ["self"], "GracefulShutdown"),
    (WORKER_GROUP_CALLBACK, "after_worker_group_start", ["self", "worker_group"], "WarmControllerProcesses"),
    (CONTROLLER_CALLBACK, "after_controller_start", ["self", "train_run_context"], "AnnounceController"),
    (FAILURE_POLICY, "make_decision", ["self", "training_failed_error"], "RerunExitToDriver"),
    (FAILURE_POLICY, "__init__", ["self", "failure_config"], None),  # super().__init__(failure_config)
    # rank_actor_runtime_env: the workers' environment as Ray Train builds it (a static method)
    (WORKER_GROUP, "_get_worker_runtime_env", ["custom_runtime_env"], None),
]

# (Ray's class, its method, what its source must still contain): where Ray calls what we
# override, and the keyword our override sets.
CALL_SITES = [
    (DATA_PARALLEL_TRAINER, "fit", "self._initialize_and_run_controller("),
    (DATA_PARALLEL_TRAINER, "fit", "scaling_policy="),
    (DATA_PARALLEL_TRAINER, "fit", "failure_policy="),
    (DATA_PARALLEL_TRAINER, "_initialize_and_run_controller", "self._register_sigint_handler("),
    (DATA_PARALLEL_TRAINER, "fit", "self._create_default_callbacks("),
    (DATA_PARALLEL_TRAINER, "_create_default_callbacks", "DatasetsCallback("),
    (ELASTIC_POLICY, None, "self._count_possible_workers("),
    # AnnounceController: the controller calls it as it starts; its abort is what the driver calls.
    (TRAIN_CONTROLLER, None, '"after_controller_start"'),
    (TRAIN_CONTROLLER, None, "async def abort(self)"),
    (RAY_WORKER, None, ".before_worker_shutdown("),
    # Ray Train's worker actors get RunConfig.worker_runtime_env (our preload hook rides on it).
    (WORKER_GROUP, None, "run_config.worker_runtime_env"),
    # rank_actor_runtime_env mirrors the controller's environment and the workers' (the driver
    # names the ranks' environment before Ray Train starts them: workers/warm_processes.py).
    (DATA_PARALLEL_TRAINER, "_initialize_and_run_controller", "env_vars = get_env_vars_to_propagate()"),
    (DATA_PARALLEL_TRAINER, "_initialize_and_run_controller", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,"),
    (DATA_PARALLEL_TRAINER, "_initialize_and_run_controller", 'runtime_env={"env_vars": env_vars}'),
    (WORKER_GROUP, None, "self._get_worker_runtime_env("),
]


def _fail(message: str) -> None:
    pytest.fail(f"{RAY}: {message} (see workers/trainer.py's docstring for what uses it)", pytrace=False)


def _load(where: tuple[str, str]):
    module, name = where
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        _fail(f"{module}.{name} is gone: {type(err).__name__}: {err}")


def _params(fn) -> list[str]:
    kinds = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [kinds.get(p.kind, p.name) for p in inspect.signature(fn).parameters.values()]


def _ours(name: str):
    try:
        import workers.trainer
    except ImportError as err:  # an internal it imports has moved
        _fail(f"workers.trainer no longer imports: {err}")
    return getattr(workers.trainer, name)


@pytest.mark.parametrize(
    ("where", "method", "expected", "ours"), METHODS, ids=[f"{w[1]}.{m}" for w, m, _, _ in METHODS]
)
def test_the_methods_we_override_or_call_keep_their_signature(where, method, expected, ours):
    cls = _load(where)
    fn = getattr(cls, method, None)
    if fn is None:
        _fail(f"{where[0]}.{where[1]}.{method} is gone")
    if _params(fn) != expected:
        _fail(f"{where[1]}.{method} now takes {inspect.signature(fn)}, workers/trainer.py expects {expected}")
    if ours is not None:
        our_cls = _ours(ours)
        assert issubclass(our_cls, cls), f"{RAY}: {ours} no longer derives from {where[1]}"
        assert _params(getattr(our_cls, method)) == expected, f"{ours}.{method} drifted from Ray's"


@pytest.mark.parametrize(
    ("where", "method", "text"), CALL_SITES, ids=[f"{w[1]}.{m or ''}:{t}" for w, m, t in CALL_SITES]
)
def test_ray_still_calls_what_we_override(where, method, text):
    cls = _load(where)
    try:
        source = inspect.getsource(getattr(cls, method) if method else cls)
    except (OSError, TypeError) as err:
        pytest.skip(f"{RAY} ships no source for {where[1]}: {err}")
    if text not in source:
        _fail(f"{where[1]}{'.' + method if method else ''} no longer contains {text!r}")


def test_the_controller_still_takes_a_scaling_policy_and_can_be_aborted():
    controller = _load(TRAIN_CONTROLLER)
    if "scaling_policy" not in inspect.signature(controller.__init__).parameters:
        _fail(f"TrainController{inspect.signature(controller.__init__)} takes no scaling_policy")
    if not callable(getattr(controller, "abort", None)):
        _fail("TrainController.abort is gone (ElastronTorchTrainer's stop handler calls it)")


def test_our_worker_callback_reaches_the_workers_and_elasticity_is_read_from_scaling(tmp_path):
    """Through the trainer's own callback list (no cluster): Ray passes run_config callbacks that
    are not UserCallbacks on as they are; Ray's dataset callback is dropped for a run without
    datasets; our policy is only swapped in when the ScalingConfig says elastic."""
    from ray.train import RunConfig, ScalingConfig

    trainer_cls, shutdown_cls = _ours("ElastronTorchTrainer"), _ours("GracefulShutdown")
    trainer = trainer_cls(
        lambda config: None,
        scaling_config=ScalingConfig(num_workers=(1, 2)),
        run_config=RunConfig(name="internals", storage_path=str(tmp_path), callbacks=[shutdown_cls()]),
        elastic_sizes=[1, 2],
    )
    try:
        callbacks = trainer._create_default_callbacks()
    except AttributeError as err:
        _fail(f"DataParallelTrainer builds its callback list differently now: {err}")
    assert any(isinstance(c, shutdown_cls) for c in callbacks), (
        f"{RAY}: a RunConfig WorkerCallback no longer reaches the controller's callbacks: "
        f"{[type(c).__name__ for c in callbacks]}"
    )
    # A run without Ray datasets starts no dataset manager actor (one more process per worker
    # group start, each replica replacement included): Ray's list has the callback, ours not.
    datasets_cls = _load(("ray.train.v2._internal.callbacks", "DatasetsCallback"))
    rays = super(trainer_cls, trainer)._create_default_callbacks()
    assert any(isinstance(c, datasets_cls) for c in rays), f"{RAY}: no DatasetsCallback any more"
    assert not any(isinstance(c, datasets_cls) for c in callbacks), (
        "a run without datasets kept Ray's DatasetsCallback"
    )
    assert getattr(trainer.scaling_config, "elasticity_enabled", None) is True, (
        f"{RAY}: ScalingConfig.elasticity_enabled is gone or false for num_workers=(1, 2)"
    )


def test_what_warm_processes_lean_on_is_still_there():
    """workers/warm_processes.py: the raylet's PrestartWorkers RPC and its fields, Ray's
    authenticated channel, the core worker's serialized runtime environment, the setup-hook
    variable Ray's own helper writes, and (workers/driver.py's launch prestart) the free
    resources per node."""
    try:
        from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR  # noqa: F401
        from ray._private import ray_constants
        from ray._private.grpc_utils import init_grpc_channel  # noqa: F401
        from ray._private.runtime_env.setup_hook import export_setup_func_module
        from ray._private.state import available_resources_per_node  # noqa: F401
        from ray._raylet import CoreWorker
        from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc
        from ray.train.v2._internal.constants import (  # noqa: F401
            DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
            get_env_vars_to_propagate,
        )
    except ImportError as err:
        _fail(f"a module workers/warm_processes.py imports is gone: {err}")
    request = node_manager_pb2.DESCRIPTOR.message_types_by_name.get("PrestartWorkersRequest")
    if request is None:
        _fail("the raylet no longer has PrestartWorkersRequest")
    fields = {f.name for f in request.fields}
    wanted = {"language", "job_id", "runtime_env_info", "keep_alive_duration_secs", "num_workers"}
    if not wanted <= fields:
        _fail(f"PrestartWorkersRequest lost {sorted(wanted - fields)}")
    service = node_manager_pb2.DESCRIPTOR.services_by_name["NodeManagerService"]
    if "PrestartWorkers" not in service.methods_by_name:
        _fail("NodeManagerService.PrestartWorkers is gone")
    if not hasattr(node_manager_pb2_grpc.NodeManagerServiceStub(_UnusedChannel()), "PrestartWorkers"):
        _fail("the generated NodeManagerServiceStub has no PrestartWorkers")
    if not callable(getattr(CoreWorker, "get_current_runtime_env", None)):
        _fail("CoreWorker.get_current_runtime_env is gone")
    env = export_setup_func_module({}, "workers.warm_processes.preload")
    if env.get("env_vars", {}).get(ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR) != "workers.warm_processes.preload":
        _fail(f"export_setup_func_module no longer writes the hook variable: {env}")


class _UnusedChannel:
    """Enough of a gRPC channel for a generated stub to build its methods (none is called)."""

    def unary_unary(self, *args, **kwargs):
        return None

    unary_stream = stream_unary = stream_stream = unary_unary


def test_a_rerun_exit_goes_to_the_driver_and_other_failures_to_rays_policy():
    """RerunExitToDriver: a rank's RerunExit (exit 16 or 17) is raised at once, whatever budget
    is left (only the driver can resume elsewhere or exclude a node); any other worker failure
    is Ray's policy's to retry."""
    from ray.train.v2._internal.execution.failure_handling import FailureDecision, create_failure_policy
    from ray.train.v2.api.config import FailureConfig
    from ray.train.v2.api.exceptions import WorkerGroupError

    from engine.rerun.state_machine import RerunExit
    from workers.trainer import RerunExitToDriver

    policy = RerunExitToDriver(create_failure_policy(FailureConfig(max_failures=4)))
    rerun = WorkerGroupError("rank 1", {0: RuntimeError("peer gone"), 1: RerunExit(16, "reproduced in place")})
    assert policy.make_decision(rerun) == FailureDecision.RAISE
    died = WorkerGroupError("rank 1", {1: RuntimeError("killed")})
    assert policy.make_decision(died) == FailureDecision.RETRY
