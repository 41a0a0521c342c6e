"""How the control plane starts, watches and stops a job's processes.

`Launcher` is the small interface the reconciler and the API use; `RayJobsLauncher` implements
it on Ray Jobs (`ray.job_submission.JobSubmissionClient`), so each training job runs as a Ray
job that outlives the API process. Tests inject their own implementation through
`create_app(settings, launcher=...)`.

Contract:
- `submit` is idempotent per `submission_id` (the reconciler chooses the id and records it
  before calling, so after a crash it can ask Ray whether the submission arrived);
- `submit_command` starts any other command (a checkpoint export) the same way: its own
  submission, idempotent per `submission_id`, watched with `status` and `message`;
- every call returns or raises within the launcher's timeout; `LauncherUnavailable` means
  "cannot tell now, try later" (Ray down, slow, or busy) and never changes a job's state;
- `stop` is graceful: Ray sends the job's driver RAY_JOB_STOP_SIGNAL, which `elastron up` sets
  to SIGINT, the signal Ray Train handles (Ray Train V2 aborts a run gracefully on SIGINT only);
- `EntrypointResources`: what a submission's entrypoint process asks Ray for. An export loads the
  whole model, so it asks for CPUs (and memory) and Ray places it on a node with room, never on
  a head started with num-cpus 0 (the Helm chart's); a job's driver asks for what the operator
  sets (nothing by default: it loads no model and runs on the head);
- `capacity` lists the cluster's nodes (alive or not, their CPU and GPU totals) for the scheduler
  (service/scheduling/), or None when the launcher cannot tell: then the reconciler hands every
  queued job to the launcher in order, as before there was a scheduler.

Ray is imported inside the methods: the API starts, and answers /healthz, without Ray.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engine.jobspec import contract
from service.scheduling.model import Node

log = logging.getLogger(__name__)


class LaunchStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    MISSING = "missing"  # the launcher has no such submission


# Not RuntimeError subclasses: Ray's SDK raises RuntimeError for everything, and these must
# never be mistaken for one of its answers.
class LauncherUnavailable(Exception):
    """The launcher cannot be reached or did not answer in time; nothing is known, retry later."""


class SubmissionRejected(Exception):
    """The launcher refused this submission; retrying the same submission will not help."""


@dataclass(frozen=True)
class EntrypointResources:
    """Ray Jobs' entrypoint_num_cpus / entrypoint_memory / entrypoint_resources for one
    submission's entrypoint process (0 and empty: no request, Ray may run it on the head)."""

    num_cpus: float = 0.0
    memory_bytes: int = 0
    custom: dict[str, float] = field(default_factory=dict)

    def ray_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.num_cpus > 0:
            kwargs["entrypoint_num_cpus"] = self.num_cpus
        if self.memory_bytes > 0:
            kwargs["entrypoint_memory"] = int(self.memory_bytes)
        if self.custom:
            kwargs["entrypoint_resources"] = dict(self.custom)
        return kwargs


def export_resources(num_cpus: float, memory_gib: float) -> EntrypointResources:
    """An export's request (settings export_num_cpus, export_memory_gib)."""
    return EntrypointResources(num_cpus=num_cpus, memory_bytes=int(memory_gib * (1 << 30)))


class Launcher(ABC):
    @abstractmethod
    def submit(
        self, job_id: str, spec_json: str, env: dict[str, str], *, submission_id: str | None = None
    ) -> str:
        """Start the job's entrypoint with `env`; returns the submission id."""

    def submit_command(
        self,
        submission_id: str,
        entrypoint: Sequence[str] | str,
        env: dict[str, str],
        *,
        resources: EntrypointResources | None = None,
    ) -> str:
        """Start `entrypoint` (argv, or one shell command line) with `env` as its own submission,
        its process placed where `resources` fit; idempotent per `submission_id`; returns it.
        Launchers that cannot run commands refuse."""
        raise SubmissionRejected(f"{self.describe()} cannot run commands")

    @abstractmethod
    def status(self, submission_id: str) -> LaunchStatus: ...

    def statuses(self, submission_ids: Iterable[str]) -> dict[str, LaunchStatus]:
        return {sid: self.status(sid) for sid in submission_ids}

    def message(self, submission_id: str) -> str | None:
        """Why a finished submission ended as it did (exit code, last log lines), when known."""
        return None

    def exit_code(self, submission_id: str) -> int | None:
        """The exit code of a finished submission's entrypoint, when known (the service explains
        the engine's own: engine/jobspec/contract.py)."""
        return None

    @abstractmethod
    def stop(self, submission_id: str) -> bool:
        """Ask the job to stop gracefully; False when it had already ended."""

    @abstractmethod
    def logs(self, submission_id: str) -> str: ...

    @abstractmethod
    def tail(self, submission_id: str) -> AsyncIterator[str]:
        """Log text as it is written, until the job ends."""

    @abstractmethod
    def reachable(self) -> bool: ...

    def capacity(self) -> list[Node] | None:
        """The cluster's nodes with their CPU and GPU totals; None: unknown (no scheduling)."""
        return None

    def describe(self) -> str:
        return type(self).__name__


_RAY_STATUS = {
    "PENDING": LaunchStatus.PENDING,
    "RUNNING": LaunchStatus.RUNNING,
    "SUCCEEDED": LaunchStatus.SUCCEEDED,
    "FAILED": LaunchStatus.FAILED,
    "STOPPED": LaunchStatus.STOPPED,
}
_HTTP_STATUS = re.compile(r"status code (\d{3})")
# Past this many jobs one list call is cheaper than a status call per job.
_LIST_THRESHOLD = 20


def worker_env(
    job_id: str,
    spec_json: str,
    api_url: str,
    api_token: str,
    placement: dict[str, int] | None = None,
    *,
    fencing_token: int | None = None,
) -> dict[str, str]:
    """The environment a job's workers get: their spec, how to report back to the API, the
    attempt's fencing token (service/fencing.py) and where the scheduler admitted them (the
    driver pins its first attempt there)."""
    env = {
        contract.ENV_JOB_ID: job_id,
        contract.ENV_JOB_SPEC: spec_json,
        contract.ENV_API_URL: api_url,
        contract.ENV_API_TOKEN: api_token,
    }
    if fencing_token is not None:
        env[contract.ENV_FENCING_TOKEN] = str(fencing_token)
    if placement:
        env[contract.ENV_PLACEMENT] = json.dumps(placement, sort_keys=True, separators=(",", ":"))
    # Ray 2.60 turns token auth on by default; a driver inside the job that connects to the
    # cluster (ray.init) needs the mode too. Pass on what this process uses.
    if os.environ.get("RAY_AUTH_MODE"):
        env["RAY_AUTH_MODE"] = os.environ["RAY_AUTH_MODE"]
    return env


class RayJobsLauncher(Launcher):
    """Ray Jobs: entrypoint `elastron worker-run {job_id}` (configurable), env in runtime_env.

    Its client sends Ray's auth token only when RAY_AUTH_MODE=token is in this process'
    environment before Ray reads it: the process entry point sets that (create_app,
    `elastron up`), not this class, so building one never changes a process-wide setting."""

    def __init__(
        self,
        address: str,
        *,
        entrypoint: str = "elastron worker-run {job_id}",
        timeout_s: float = 5.0,
        driver_resources: EntrypointResources | None = None,
    ):
        self.address = address
        self.driver_resources = driver_resources or EntrypointResources()
        self.entrypoint = entrypoint
        self.timeout_s = timeout_s
        self._client_obj: Any = None
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"Ray at {self.address}"

    # -- the client -------------------------------------------------------------------------

    def _client(self) -> Any:
        with self._lock:
            if self._client_obj is None:
                self._client_obj = self._translate(self._new_client)
            return self._client_obj

    def _new_client(self) -> Any:
        from ray.job_submission import JobSubmissionClient

        timeout = self.timeout_s

        class _Client(JobSubmissionClient):
            # The SDK sends requests without a timeout; a hung dashboard would hang us.
            def _do_request(self, method, endpoint, **kwargs):  # noqa: ANN001
                kwargs.setdefault("timeout", timeout)
                return super()._do_request(method, endpoint, **kwargs)

        return _Client(self.address)

    def _translate(self, call, *args: Any, **kwargs: Any) -> Any:
        """Run a client call; map "cannot tell now" failures to LauncherUnavailable."""
        import requests
        from ray.exceptions import AuthenticationError

        try:
            return call(*args, **kwargs)
        except (requests.RequestException, ConnectionError, TimeoutError) as err:
            self._drop_client()
            raise LauncherUnavailable(f"Ray at {self.address} is unreachable: {err}") from err
        except AuthenticationError as err:
            self._drop_client()
            raise LauncherUnavailable(
                f"Ray at {self.address} refused our credentials (set RAY_AUTH_MODE=token and provide the "
                f"cluster's token in RAY_AUTH_TOKEN or ~/.ray/auth_token): {err}"
            ) from err
        except RuntimeError as err:
            code = _http_status(err)
            # Ray wraps some answers (a duplicate submission id) in a 500 from the head node.
            if code is not None and code >= 500 and "already exists" not in str(err):
                raise LauncherUnavailable(f"Ray at {self.address} is not ready: {err}") from err
            raise

    def _drop_client(self) -> None:
        self._client_obj = None

    # -- the interface ----------------------------------------------------------------------

    def submit(
        self, job_id: str, spec_json: str, env: dict[str, str], *, submission_id: str | None = None
    ) -> str:
        client = self._client()
        try:
            return self._translate(
                client.submit_job,
                entrypoint=self.entrypoint.format(job_id=job_id),
                submission_id=submission_id,
                runtime_env={"env_vars": dict(env)},
                metadata={"elastron_job_id": job_id},
                **self.driver_resources.ray_kwargs(),
            )
        except RuntimeError as err:
            if submission_id and "already exists" in str(err):
                return submission_id  # an earlier attempt got through: submit is idempotent
            raise SubmissionRejected(str(err)) from err

    def submit_command(
        self,
        submission_id: str,
        entrypoint: Sequence[str] | str,
        env: dict[str, str],
        *,
        resources: EntrypointResources | None = None,
    ) -> str:
        """A Ray job running `entrypoint` (argv is shell-quoted into Ray's one command line),
        its process placed by Ray where `resources` fit."""
        command = entrypoint if isinstance(entrypoint, str) else shlex.join(entrypoint)
        client = self._client()
        try:
            return self._translate(
                client.submit_job,
                entrypoint=command,
                submission_id=submission_id,
                runtime_env={"env_vars": dict(env)},
                metadata={"elastron_command": command[:256]},
                **(resources or EntrypointResources()).ray_kwargs(),
            )
        except RuntimeError as err:
            if "already exists" in str(err):
                return submission_id  # an earlier attempt got through: idempotent
            raise SubmissionRejected(str(err)) from err

    def status(self, submission_id: str) -> LaunchStatus:
        client = self._client()
        try:
            status = self._translate(client.get_job_status, submission_id)
        except RuntimeError as err:
            if _is_missing(err):
                return LaunchStatus.MISSING
            raise LauncherUnavailable(f"Ray could not report {submission_id}: {err}") from err
        return _RAY_STATUS[str(status.value if hasattr(status, "value") else status)]

    def statuses(self, submission_ids: Iterable[str]) -> dict[str, LaunchStatus]:
        wanted = list(submission_ids)
        if len(wanted) <= _LIST_THRESHOLD:
            return super().statuses(wanted)
        client = self._client()
        try:
            found = {
                d.submission_id: _RAY_STATUS[str(d.status.value)]
                for d in self._translate(client.list_jobs)
                if d.submission_id
            }
        except RuntimeError as err:
            raise LauncherUnavailable(f"Ray could not list jobs: {err}") from err
        return {sid: found.get(sid, LaunchStatus.MISSING) for sid in wanted}

    def _job_info(self, submission_id: str) -> Any:
        """Ray's JobDetails of a submission; None where Ray does not answer with them."""
        try:
            return self._translate(self._client().get_job_info, submission_id)
        except RuntimeError:
            return None

    def message(self, submission_id: str) -> str | None:
        info = self._job_info(submission_id)
        return None if info is None else info.message

    def exit_code(self, submission_id: str) -> int | None:
        info = self._job_info(submission_id)
        return None if info is None else info.driver_exit_code

    def stop(self, submission_id: str) -> bool:
        client = self._client()
        try:
            return bool(self._translate(client.stop_job, submission_id))
        except RuntimeError as err:
            if _is_missing(err):
                return False
            raise LauncherUnavailable(f"Ray could not stop {submission_id}: {err}") from err

    def logs(self, submission_id: str) -> str:
        client = self._client()
        try:
            return self._translate(client.get_job_logs, submission_id)
        except RuntimeError as err:
            if _is_missing(err):
                return ""
            raise LauncherUnavailable(f"Ray could not return the logs of {submission_id}: {err}") from err

    async def tail(self, submission_id: str) -> AsyncIterator[str]:
        client = await asyncio.to_thread(self._client)
        try:
            async for chunk in client.tail_job_logs(submission_id):
                yield chunk
        except Exception as err:  # aiohttp's errors, Ray's RuntimeErrors: the stream is gone either way
            raise LauncherUnavailable(f"the log stream of {submission_id} from Ray broke off: {err}") from err

    def capacity(self) -> list[Node] | None:
        """Ray's nodes from the dashboard's State API (`GET /api/v0/nodes`, what `ray list nodes`
        reads): one HTTP call through the Jobs client (its auth and timeout), no ray.init, no Ray
        Train in this process. Dead nodes are listed with alive=False."""
        client = self._client()
        try:
            response = self._translate(client._do_request, "GET", "/api/v0/nodes?limit=10000&detail=false")
        except RuntimeError as err:
            raise LauncherUnavailable(f"Ray could not list its nodes: {err}") from err
        if response.status_code != 200:
            raise LauncherUnavailable(f"Ray could not list its nodes: HTTP {response.status_code}")
        return nodes_from_state_api(response.json())

    def reachable(self) -> bool:
        try:
            client = self._client()
            self._translate(client._do_request, "GET", "/api/version").raise_for_status()
        except Exception as err:  # any failure here means "not usable now"
            log.debug("Ray at %s is not reachable: %s", self.address, err)
            self._drop_client()
            return False
        return True


def nodes_from_state_api(body: dict[str, Any]) -> list[Node]:
    """`GET /api/v0/nodes` -> nodes: {"data": {"result": {"result": [{"node_id", "state",
    "resources_total": {"CPU": .., "GPU": ..}}, ...]}}}."""
    rows = (((body or {}).get("data") or {}).get("result") or {}).get("result") or []
    return [
        Node(
            id=str(row.get("node_id")),
            cpus=float((row.get("resources_total") or {}).get("CPU", 0.0)),
            gpus=float((row.get("resources_total") or {}).get("GPU", 0.0)),
            alive=row.get("state") == "ALIVE",
        )
        for row in rows
    ]


def _http_status(err: Exception) -> int | None:
    match = _HTTP_STATUS.search(str(err))
    return int(match.group(1)) if match else None


def _is_missing(err: Exception) -> bool:
    text = str(err)
    return _http_status(err) == 404 or "does not exist" in text or "not found" in text.lower()
