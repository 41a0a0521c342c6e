"""The job driver: one process per training job (`elastron worker-run JOB_ID`), the entry point
Ray Jobs starts, turning a JobSpec into Ray Train V2 runs until the job is done.

Process model:

    Ray Jobs supervisor ── elastron worker-run JOB_ID        (this module: the driver loop)
                               ├─ job registry actor         (workers/registry.py, 0 CPU, on this node)
                               │   └─ snapshot holders, one per node (workers/snapshots.py, with
                               │      checkpoint.local_interval: owned through the registry, so
                               │      they die with the driver; killed at the job's end)
                               └─ TorchTrainer.fit()  ×  attempts
                                    ├─ Ray Train controller  (polls the ranks, resizes elastic groups)
                                    └─ one RayTrainWorker actor per rank ── workers.rank.rank_main
                                                                             └─ engine.train_loop.train_rank

Under `resilience.on_rank_failure: restart_group` (the default) the driver calls `fit()` with
Ray's own retries off (`FailureConfig(max_failures=0)`), so every failure comes back here with its per-rank causes (`WorkerGroupError.worker_failures`, the rerun
state machine's RerunExit among them). `workers.policy.RestartPolicy` decides: restart within
`resilience.max_restarts`, resume elsewhere (exit 16), exclude a node (exit 17, persistent
error), or fail. Each attempt is a new `fit()` under the same run name (the job id), and the
engine resumes from the newest committed checkpoint in the job's storage every time. Elastic
resizes happen inside one attempt: Ray Train's controller restarts the group with another size
(`resources.min_ranks`..`max_ranks`), and the engine resumes with another data-parallel size.
With `resilience.on_rank_failure: replace_replica` (workers/replicas.py) the attempt runs on Ray
Train's TorchftConfig with `max_failures` = the restarts left: the controller replaces a failed
replica group inside the attempt while the others train on, and only an attempt that fails for
good comes back here.

The spec the ranks get is prepared once, before the first attempt (workers/spec_on_ray.py). Each
decision is an event, sent to the control plane and printed on the Ray Jobs log
(workers/driver_events.py).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.jobspec import JobSpec, JobSpecError, resolve_job
from engine.jobspec.demand import CPUS_PER_RANK, rank_resources, run_sizes
from engine.jobspec.storage_roots import StorageOutsideRoots, check_spec_within
from workers.driver_events import DriverEvents
from workers.policy import (
    EXIT_BAD_INPUT,
    EXIT_CANCELLED,
    EXIT_FAILED,
    Outcome,
    RestartPolicy,
    classify,
)
from workers.replicas import check_replace_replica, replace_replica
from workers.spec_on_ray import JobInputError, default_storage_path, prepare_spec
from workers.telemetry import telemetry_settings

log = logging.getLogger(__name__)

# Set in this process unless already set; Ray Train passes them on to its controller.
RAY_ENV_DEFAULTS = {
    # After a lost node, Ray Train may first try the old size and wait this long for it to
    # start (the 60 s default cost 74 s of downtime; 15 s cost 19 s).
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15",
    # The controller's poll: how soon a failure or a finished group is noticed (bench/recovery.py:
    # 1 s -> 0.9-1.1 s from SIGKILL to the driver knowing, 0.2 s -> 0.3 s; each poll is one small
    # actor call per rank).
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # Ranks resolve paths themselves (made absolute here); no chdir into Ray's run folder.
    "RAY_CHDIR_TO_TRIAL_DIR": "0",
    # Ray Train's print patch both tees a rank's print to stdout and logs it to stderr (Ray's
    # workers replace sys.stdout), so every progress line reached the job's log twice.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}


@dataclass
class WorkerRunOptions:
    address: str | None = None  # Ray address; default: RAY_ADDRESS, else a running or new local Ray
    storage_path: str | None = None  # Ray Train's run storage; default ELASTRON_RAY_STORAGE or ~/ray_results
    metrics_out: str | None = None  # rank 0 also writes its records here (a path on rank 0's node)
    quiet: bool = False
    flush_interval_s: float = 1.0  # telemetry batching
    resize_interval_s: float | None = None  # elastic: how often to check for room to grow (default 60 s)
    cpus_per_rank: float = CPUS_PER_RANK
    # {Ray node id: ranks} the service's scheduler admitted the job on (ELASTRON_PLACEMENT)
    placement: dict[str, int] | None = None
    # replace_replica: the Lighthouse's liveness relay (engine/fault_tolerance/lighthouse.py); off is
    # torchft's Lighthouse alone, bench/recovery.py's same-run comparison
    replica_relay: bool = True
    # Ask the nodes a group will start on for its ranks' processes before Ray Train's controller
    # starts (workers/warm_processes.py); off is Ray Train starting them, bench/recovery.py's
    # `launch` comparison
    prestart_ranks: bool = True


@dataclass
class JobResult:
    exit_code: int
    reason: str
    attempts: int = 0
    restarts_used: int = 0
    excluded_nodes: list[str] = field(default_factory=list)
    last: dict[str, Any] | None = None  # rank 0's last record summary on success


# ---------------------------------------------------------------------- the cluster
def lost_nodes(node_ids: set[str], timeout_s: float = 1.0) -> set[str]:
    """Which of these Ray nodes are gone: marked dead, or still listed alive but with no raylet
    answering on its port (Ray notices a vanished node only after its heartbeats time out)."""
    import ray

    lost = set()
    for node in ray.nodes():
        if node["NodeID"] not in node_ids:
            continue
        if not node.get("Alive"):
            lost.add(node["NodeID"])
            continue
        try:
            with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout_s):
                pass
        except OSError:
            lost.add(node["NodeID"])
    return lost | (node_ids - {n["NodeID"] for n in ray.nodes()})


# ---------------------------------------------------------------------- the driver loop
class JobDriver:
    def __init__(self, job_id: str, spec: JobSpec, options: WorkerRunOptions | None = None):
        self.job_id, self.spec = job_id, spec
        self.options = options or WorkerRunOptions()
        self.sizes = run_sizes(spec)
        if not self.sizes:
            raise JobInputError("no rank count between resources.min_ranks and max_ranks can run this job")
        why = check_replace_replica(spec)
        if why is not None:
            raise JobInputError(why)
        self.spec_dict = prepare_spec(job_id, spec, self.options.storage_path)
        try:  # the roots the service gave this job (ELASTRON_STORAGE_ROOTS): checked again here
            check_spec_within(self.spec_dict)
        except StorageOutsideRoots as err:
            raise JobInputError(str(err)) from None
        self.job = resolve_job(self.spec_dict)  # what the ranks get: typed, resolved once here
        self.stop = threading.Event()
        self.events = DriverEvents(job_id, self.options.flush_interval_s)
        self.registry = None
        self.use_gpu = False
        self.lost_nodes: set[str] = set()
        self.policy = RestartPolicy(spec.resilience.max_restarts, self.room)

    # -------------------------------------------------------------- the cluster
    def _per_rank(self) -> dict[str, float]:
        # The rule lives in engine/jobspec/demand.py: the service's scheduler counts the same.
        return rank_resources(self.use_gpu, self.options.cpus_per_rank)

    def room(self, blocked: set[str]) -> bool:
        """Whether live nodes outside `blocked` have room for the job's smallest size."""
        import ray

        fits = 0
        for node in ray.nodes():
            if not node.get("Alive") or node["NodeID"] in blocked:
                continue
            fits += self._ranks_that_fit(node.get("Resources", {}))
        return fits >= self.sizes[0]

    def _ranks_that_fit(self, have: dict[str, float]) -> int:
        """How many of this job's ranks the resources `have` hold."""
        per = {k: v for k, v in self._per_rank().items() if v > 0}
        return int(min(have.get(k, 0.0) // v for k, v in per.items())) if per else 0

    def _connect(self) -> None:
        import ray

        for key, value in RAY_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if not ray.is_initialized():
            from workers.warm_processes import job_runtime_env

            ray.init(
                address=self.options.address,
                log_to_driver=True,
                # Fast-recovery jobs: every process of the job imports Ray Train and torch as it
                # starts, so a warm one started ahead takes a restart's controller in ~0.1 s.
                runtime_env=job_runtime_env() if self.job.warm_restart else None,
            )
        device = self.spec.resources.device
        gpus = ray.cluster_resources().get("GPU", 0)
        if device == "cuda" and not gpus:
            raise JobInputError(
                "resources.device is 'cuda' but the Ray cluster has no GPUs: use 'cpu' or 'auto'"
            )
        self.use_gpu = device == "cuda" or (device == "auto" and gpus > 0)

    def _start_registry(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from workers.registry import NAMESPACE, JobRegistry, registry_name

        name = registry_name(self.job_id)
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            raise JobInputError(f"job {self.job_id} already has a running driver on this cluster")
        here = ray.get_runtime_context().get_node_id()
        self.registry = (
            ray.remote(num_cpus=0, max_restarts=0)(JobRegistry)
            .options(
                name=name,
                namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
            )
            .remote(self.job_id, telemetry_settings())
        )
        ray.get(self.registry.ping.remote())

    # -------------------------------------------------------------- signals
    def _on_stop(self) -> None:
        self.stop.set()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if not hasattr(self, "_previous_handlers"):
            self._previous_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum, frame):
            self._on_stop()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    # -------------------------------------------------------------- one attempt
    def _trainer(self, attempt: int, replica: dict[str, Any] | None = None):
        """The attempt's TorchTrainer; `replica` (resilience.resize: live, workers/replica_fits.py):
        one replica group's run instead, {"replica_slot", "replica_slots", "replicas_expected",
        "lighthouse", "replica_run"} for its ranks, on a process group of its own ranks, never retried
        by Ray."""
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig

        from workers.rank import rank_main
        from workers.trainer import (
            AnnounceController,
            ElastronTorchTrainer,
            GracefulShutdown,
            WarmControllerProcesses,
            torchft_config,
        )
        from workers.warm_processes import rank_runtime_env

        r = self.spec.resources
        # Nodes the last attempt lost stay out of this one even while Ray still lists them
        # (it marks a vanished node dead only after ~15 s of missed heartbeats; placing ranks on it
        # meanwhile would cost RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S).
        blocked = self.policy.blocked | self.lost_nodes
        elastic = r.elastic and replica is None
        if replica is not None:
            from workers.placement import exclusion
            from workers.replicas import replica_size

            workers, selector = replica_size(self.spec), exclusion(blocked)
        else:
            workers = (self.sizes[0], self.sizes[-1]) if elastic else self.sizes[0]
            selector = self._placement(attempt, blocked, elastic)
        scaling = ScalingConfig(
            num_workers=workers,
            use_gpu=self.use_gpu,
            resources_per_worker=self._per_rank(),
            label_selector=selector,
            elastic_resize_monitor_interval_s=self.options.resize_interval_s
            or float(os.environ.get("ELASTRON_RESIZE_INTERVAL_S", 60.0)),
        )
        pg_timeout = self.job.process_group_timeout_s
        replicas = replace_replica(self.spec) and replica is None  # (Ray's replica groups)
        return ElastronTorchTrainer(
            rank_main,
            train_loop_config={
                "job_id": self.job_id,
                "attempt": attempt,
                "job": self.job,
                "device": "cuda" if self.use_gpu else "cpu",
                "metrics_out": self.options.metrics_out,
                "quiet": self.options.quiet,
                "flush_interval_s": self.options.flush_interval_s,
                "attempt_started_at": time.time(),  # a restart's phases are timed from here
                **(replica or {}),
            },
            # replace_replica: one process group per replica, Ray's controller replacing a failed
            # replica group within the attempt (each replacement counted against max_restarts;
            # a failure of every replica restarts the group, and once the budget is spent the
            # attempt fails here as with restart_group).
            torch_config=torchft_config(
                pg_timeout,
                self.spec.resilience.replica_heartbeat_timeout_ms,
                relay=self.options.replica_relay,
            )
            if replicas
            else TorchConfig(timeout_s=pg_timeout),
            scaling_config=scaling,
            run_config=RunConfig(
                name=self.job_id if replica is None else f"{self.job_id}-replica{replica['replica_slot']}",
                storage_path=self.options.storage_path or default_storage_path(),
                failure_config=FailureConfig(max_failures=self._replica_budget() if replicas else 0),
                callbacks=[GracefulShutdown()]
                # (a replica group's run: ReplicaFits keeps the job's warm processes instead, and
                # aborts the run through the controller it announces)
                + ([WarmControllerProcesses()] if self.job.warm_restart and replica is None else [])
                + ([AnnounceController(self.job_id, replica["replica_slot"])] if replica is not None else []),
                # Rank processes import torch and the engine at their start, which lets a warm
                # process started ahead take a restarted rank (workers/warm_processes.py).
                worker_runtime_env=rank_runtime_env(),
            ),
            elastic_sizes=self.sizes if elastic else None,
            blocked_nodes=blocked,
            on_stop=self._on_stop,
        )

    def _replica_budget(self) -> int:
        """replace_replica: the restarts left, which Ray Train's controller spends on replacing
        replicas within the attempt (a failed attempt has spent them all: workers/policy.py)."""
        return max(0, self.policy.max_restarts - self.policy.restarts_used)

    def _placement(self, attempt: int, blocked: set[str], elastic: bool):
        """Label selectors of the attempt's workers (workers/placement.py): where the scheduler
        admitted the job (ELASTRON_PLACEMENT) on its first attempt, and always for an elastic
        job's nodes; after a restart each rank back on its previous node where that node is
        still usable; else just off the blocked nodes."""
        import ray

        from workers.placement import exclusion, scheduled_selectors, sticky_selectors

        scheduled = self.options.placement if (attempt == 0 or elastic) else None
        may_stick = not elastic and attempt > 0 and self.registry is not None
        if scheduled is None and not may_stick:
            return exclusion(blocked)
        try:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if scheduled is not None:
                pinned = scheduled_selectors(scheduled, self.sizes[0], alive, blocked, elastic)
                if pinned is not None:
                    self.events.placement_scheduled(attempt, scheduled)
                    return pinned
            if not may_stick:
                return exclusion(blocked)
            previous = ray.get(self.registry.last_group.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a GCS hiccup: place the group freely
            return exclusion(blocked)
        sticky = sticky_selectors(previous, attempt, self.sizes[0], alive, blocked)
        if sticky is None:
            return exclusion(blocked)
        self.events.placement_sticky(attempt, sticky)
        return sticky

    def _launch_nodes(self, attempt: int, blocked: set[str]) -> dict[str, int] | None:
        """Where this attempt's ranks will run ({node: ranks}) when the driver knows it before Ray
        Train places them: the scheduler's placement (a first attempt, or an elastic job's), or a
        fixed-size group that needs every free slot of the usable nodes. None when Ray picks, and
        after a restart of a job whose ranks started their own warm processes."""
        import ray

        elastic = self.spec.resources.elastic
        if attempt > 0 and self.job.warm_restart:
            return None
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        scheduled = self.options.placement if (attempt == 0 or elastic) else None
        if scheduled:
            return {n: k for n, k in scheduled.items() if k > 0 and n in alive and n not in blocked} or None
        if elastic:
            return None
        slots = self.free_ranks(blocked)
        return slots if sum(slots.values()) == self.sizes[0] else None

    def free_ranks(self, blocked: set[str]) -> dict[str, int]:
        """{node: this job's ranks its free resources hold now}, over live nodes outside `blocked`."""
        import ray
        from ray._private.state import available_resources_per_node  # private: per-node room

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        slots = {}
        for node, have in available_resources_per_node().items():
            if node in alive and node not in blocked and (fits := self._ranks_that_fit(have)) > 0:
                slots[node] = fits
        return slots

    def _prestart_ranks(self, attempt: int) -> None:
        """Ask the nodes this attempt's ranks will run on for their processes now, so that their
        imports run beside the controller's start (workers/warm_processes.py). Never fails the
        attempt: without them the ranks start as Ray starts them."""
        if not self.options.prestart_ranks:
            return
        try:
            nodes = self._launch_nodes(attempt, self.policy.blocked | self.lost_nodes)
            if not nodes:
                return
            from workers.trainer import rank_actor_runtime_env
            from workers.warm_processes import prestart_for_launch, rank_runtime_env

            asked = prestart_for_launch(nodes, rank_actor_runtime_env(rank_runtime_env()))
            log.info("elastron: %d rank processes asked for ahead on %d nodes", asked, len(nodes))
        except Exception:  # noqa: BLE001 - an optimisation, never a failure
            log.warning("could not ask for the ranks' processes ahead", exc_info=True)

    def _attempt(self, attempt: int) -> tuple[Outcome, dict | None]:
        import ray
        from ray.train import ControllerError, WorkerGroupError

        if self.spec.live_resize:  # one Ray Train run per replica group (workers/replica_fits.py)
            from workers.replica_fits import ReplicaFits

            self.lost_nodes = set()
            return ReplicaFits(self, attempt).run()
        self._prestart_ranks(attempt)
        trainer = self._trainer(attempt)
        self.lost_nodes = set()
        try:
            result = trainer.fit()
            return Outcome(succeeded=True), result.return_value
        except WorkerGroupError as err:
            if self.stop.is_set():
                return Outcome(cancelled=True), None
            group = ray.get(self.registry.last_group.remote(attempt)) or {"ranks": []}
            ranks = {r["rank"]: r for r in group["ranks"]}
            pids = {r["pid"]: r["rank"] for r in group["ranks"]}
            dogs = {
                pids.get(w["pid"], w["rank"]): w["message"]
                for w in ray.get(self.registry.watchdog_reports.remote(attempt))
                if w["pid"] in pids
            }
            self.lost_nodes = lost_nodes({r["node_id"] for r in group["ranks"]})
            causes = classify(err.worker_failures, ranks, dogs, self.lost_nodes)
            # replace_replica: Ray Train raises only once its max_failures (the restarts left)
            # are spent on replacements; without this charge each attempt would get them anew.
            spent = self._replica_budget() if replace_replica(self.spec) else 0
            return Outcome(causes=causes, nodes={r["node_id"] for r in group["ranks"]}, restarts_spent=spent), None
        except ControllerError as err:
            if self.stop.is_set():
                return Outcome(cancelled=True), None
            return Outcome(error=f"Ray Train controller: {err.controller_failure!r}"), None
        except Exception as err:  # noqa: BLE001 - the controller died (e.g. aborted), the cluster went away
            if self.stop.is_set():
                return Outcome(cancelled=True), None
            return Outcome(error=f"{type(err).__name__}: {err}"), None
        finally:
            self._install_signal_handlers()  # fit() installed its own for the run

    # -------------------------------------------------------------- the job
    def run(self) -> JobResult:
        import ray

        self._install_signal_handlers()
        self.events.start()
        attempt, result = 0, None
        try:
            self._connect()
            self._start_registry()
            self.events.job_started(
                self.spec, self.sizes, self.spec_dict["checkpoint"]["path"], "cuda" if self.use_gpu else "cpu"
            )
            while True:
                if self.stop.is_set():
                    result = self._finish(
                        "cancelled", EXIT_CANCELLED, "cancelled before the next attempt", attempt
                    )
                    break
                self.events.attempt_started(attempt, self.policy)
                started = time.time()
                outcome, last = self._attempt(attempt)
                decision = self.policy.decide(outcome)
                if not outcome.succeeded and not outcome.cancelled:
                    self.events.attempt_failed(attempt, started, outcome)
                self.events.decided(attempt, decision, self.policy)
                if decision.action == "restart":
                    attempt += 1
                    continue
                result = self._finish(decision.action, decision.exit_code, decision.reason, attempt, last)
                break
        except (JobInputError, JobSpecError) as err:
            result = self._finish("failed", EXIT_BAD_INPUT, str(err), attempt)
        except Exception as err:  # noqa: BLE001 - e.g. no Ray cluster to connect to
            traceback.print_exc()
            result = self._finish("failed", EXIT_FAILED, f"{type(err).__name__}: {err}", attempt)
        finally:
            if self.spec.checkpoint.local_interval:
                from workers.snapshots import kill_holders

                try:  # the in-memory checkpoints' holders end with the job, their files first
                    kill_holders(self.job_id)
                except Exception:  # noqa: BLE001
                    pass
            if self.registry is not None:  # (the holders' owner: after them)
                try:
                    ray.kill(self.registry)
                except Exception:  # noqa: BLE001
                    pass
            for signum, previous in getattr(self, "_previous_handlers", {}).items():
                signal.signal(signum, previous)
            self.events.close(10)
        return result

    def _finish(
        self, action: str, code: int, reason: str, attempt: int, last: dict | None = None
    ) -> JobResult:
        result = JobResult(
            exit_code=code,
            reason=reason,
            attempts=attempt + 1,
            restarts_used=self.policy.restarts_used,
            excluded_nodes=sorted(self.policy.excluded),
            last=last,
        )
        self.events.job_ended(action, **asdict(result))
        return result


def run_job(job_id: str, spec: JobSpec, options: WorkerRunOptions | None = None) -> JobResult:
    """Run the job to its end on the Ray cluster (see the module docstring); never raises for a
    job that fails, it returns the exit code and the reason."""
    try:
        driver = JobDriver(job_id, spec, options)
    except (JobInputError, JobSpecError) as err:
        return JobResult(EXIT_BAD_INPUT, str(err))
    return driver.run()
