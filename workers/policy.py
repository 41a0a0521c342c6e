"""What the driver does after each attempt of a job: the restart budget, the rerun state
machine's exit codes, and node exclusion. Pure logic (no Ray calls), so every branch is tested
without a cluster.

An attempt is one `TorchTrainer.fit()`; it ends in success, in a cancel, or with the per-rank
failures Ray Train reports (`WorkerGroupError.worker_failures`: rank -> exception). Those are
classified (`classify`) into one cause per rank, the likely root cause first:

- `rerun`: the rank raised RerunExit (the engine's rerun state machine; exit code 16 or 17);
- `storage`: the rank's checkpoints cannot be saved (CheckpointStorageError: the engine already
  retried and skipped as `checkpoint.on_save_failure` says; a restart would only fail again);
- `watchdog`: the rank's step watchdog killed it (it left its message with the job registry);
- `died`: the rank's process or node died (SIGKILL, OOM, node removed) without a Python error;
- `raised`: the rank raised an exception of its own;
- `peer`: the rank only lost a peer (gloo "connection closed by peer" and the like) -- the
  consequence of another rank's failure, listed last.

and `RestartPolicy.decide` turns the outcome into a `Decision`:

| outcome | decision | counts against resilience.max_restarts |
|---|---|---|
| success | done, exit 0 | |
| cancelled (SIGINT/SIGTERM) | stop, exit 130 | |
| exit 16 (a rejected result reproduced in place) | restart from the checkpoint it just saved, avoiding the nodes it ran on; fail with 16 when the cluster has no room elsewhere | no |
| exit 17, persistent error | exclude the nodes of the attempt that exited 16 for the rest of the job, resume; fail with 17 when no room is left | no |
| exit 17, correct result (skip_bad_batches false) or no diagnosis | fail with 17 and the diagnosis | |
| checkpoint storage failing (CheckpointStorageError), or a checkpoint no resume reads (CheckpointFormatError: the old pickled format) | fail with exit 1 and the storage error: no crash loop | |
| anything else (raise, kill, node lost, watchdog, ...) | restart from the newest committed checkpoint while the budget lasts, else fail with exit 1 and the per-rank causes | yes |

A transient error never reaches the driver: the engine re-runs the step in place and goes on.
With `resilience.skip_bad_batches` the engine skips a batch whose bad result reproduces on
other hardware instead of exiting 17, so that case never reaches the driver either.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.checkpointing.save_failures import CheckpointStorageError
from engine.rerun.state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunExit,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_CANCELLED = 130

# How a rank that only lost its peer reports it (gloo on CPU, NCCL on GPU, torch's store).
PEER_LOSS_PATTERNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "nccl communicator was aborted",
    "ncclremoteerror",
    "socket timeout",
    "timed out",
    "connection refused",
    "terminated after another rank failed",
)
DEATH_TYPES = {
    "ActorDiedError",
    "ActorUnavailableError",
    "RayActorError",
    "WorkerCrashedError",
    "NodeDiedError",
    "WorkerHealthCheckFailedError",
    "WorkerHealthCheckTimeoutError",
    "OutOfMemoryError",
}
KIND_ORDER = {"rerun": 0, "storage": 1, "watchdog": 2, "died": 3, "raised": 4, "peer": 5}


@dataclass
class RankCause:
    rank: int
    kind: str  # rerun | storage | watchdog | died | raised | peer
    message: str  # one line
    exit_code: int | None = None
    diagnosis: str | None = None
    node_id: str | None = None
    pid: int | None = None

    def line(self) -> str:
        where = f" (node {self.node_id[:12]}, pid {self.pid})" if self.node_id else ""
        return f"rank {self.rank}{where}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "kind": self.kind,
            "message": self.message,
            "exit_code": self.exit_code,
            "diagnosis": self.diagnosis,
            "node_id": self.node_id,
            "pid": self.pid,
        }


def _unwrap(err: BaseException) -> BaseException:
    """The user's exception inside Ray's wrappers (UserExceptionWithTraceback, RayTaskError)."""
    seen = 0
    while seen < 5:
        inner = getattr(err, "_base_exc", None) or getattr(err, "cause", None)
        if not isinstance(inner, BaseException) or inner is err:
            return err
        err, seen = inner, seen + 1
    return err


def _one_line(text: str, limit: int = 400) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    # A traceback's last line names the exception; Ray's death messages put it first.
    line = lines[-1] if lines[0].startswith("Traceback") else lines[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _death_message(text: str) -> str:
    """Ray's long death report, shortened to why and how the process went away."""
    why = re.search(r"The actor is dead because ([^.]*)\.", text)
    detail = re.search(r"Worker exit detail: ([^.]*)\.", text)
    message = (
        f"the rank's process died: {why.group(1)}"
        if why
        else f"the rank's process died: {_one_line(text, 200)}"
    )
    if detail:
        message += f" ({detail.group(1)}: killed by a signal such as SIGKILL, the OOM killer, or a crash)"
    return message


def _is_death(err: BaseException) -> bool:
    return any(cls.__name__ in DEATH_TYPES for cls in type(err).__mro__)


def classify(
    worker_failures: dict[int, BaseException],
    ranks: dict[int, dict] | None = None,
    watchdog: dict[int, str] | None = None,
    dead_nodes: set[str] | None = None,
) -> list[RankCause]:
    """One cause per failed rank, the likely root cause first.

    `ranks`: rank -> {"node_id", "pid"} of the group that failed (from the job registry);
    `watchdog`: rank -> the message its watchdog left before killing it; `dead_nodes`: nodes no
    longer alive in the cluster. Ray reports the failures it saw first: when a node goes, often
    only the surviving ranks' "connection closed by peer" -- so a rank Ray did not list is named
    too, when its node is dead or when every listed rank only lost a peer."""
    ranks, watchdog, dead_nodes = ranks or {}, watchdog or {}, dead_nodes or set()
    causes = []
    for rank, raw in sorted(worker_failures.items()):
        err = _unwrap(raw)
        info = ranks.get(rank, {})
        cause = RankCause(rank, "raised", "", node_id=info.get("node_id"), pid=info.get("pid"))
        if isinstance(err, RerunExit):
            cause.kind, cause.exit_code, cause.diagnosis = "rerun", err.exit_code, err.diagnosis
            cause.message = f"RerunExit (exit {err.exit_code}): {err.message}"
        elif isinstance(err, CheckpointStorageError) or {"CheckpointStorageError", "CheckpointFormatError"} & {
            cls.__name__ for cls in type(err).__mro__
        }:  # a restart would fail the same way (issue 34; issue 61: by name, metadata_json needs torch)
            cause.kind, cause.message = "storage", _one_line(str(err), 1000)
        elif rank in watchdog:
            cause.kind, cause.message = "watchdog", watchdog[rank]
        elif _is_death(err):
            cause.kind, cause.message = "died", _death_message(str(err))
        else:
            text = f"{type(err).__name__}: {_one_line(str(err))}"
            cause.kind = "peer" if any(p in str(err).lower() for p in PEER_LOSS_PATTERNS) else "raised"
            cause.message = text
        causes.append(cause)
    # Ranks the watchdog killed but whose failure Ray did not list (it lists what it saw).
    for rank, message in watchdog.items():
        if rank not in worker_failures:
            info = ranks.get(rank, {})
            causes.append(
                RankCause(rank, "watchdog", message, node_id=info.get("node_id"), pid=info.get("pid"))
            )
    only_peers = bool(causes) and all(c.kind == "peer" for c in causes)
    listed = {c.rank for c in causes}
    for rank, info in sorted(ranks.items()):
        if rank in listed:
            continue
        node = info.get("node_id")
        if node in dead_nodes:
            message = f"its node {node} left the cluster (lost or removed) with the rank on it"
        elif only_peers:
            message = (
                "no report from this rank while the others lost their connection to it: its process "
                "died (killed, out of memory) or its node went away"
            )
        else:
            continue
        causes.append(RankCause(rank, "died", message, node_id=node, pid=info.get("pid")))
    return sorted(causes, key=lambda c: (KIND_ORDER[c.kind], c.rank))


@dataclass
class Outcome:
    """How one attempt ended."""

    succeeded: bool = False
    cancelled: bool = False
    causes: list[RankCause] = field(default_factory=list)
    nodes: set[str] = field(default_factory=set)  # the nodes the failed group ran on
    error: str | None = None  # a failure outside the worker group (controller, cluster)
    # Restarts the attempt spent inside itself (replace_replica: Ray Train replaced failed
    # replicas within the attempt, each one of resilience.max_restarts).
    restarts_spent: int = 0

    def summary(self) -> str:
        if self.causes:
            return "; ".join(c.line() for c in self.causes)
        return self.error or ""


@dataclass
class Decision:
    action: str  # "restart" | "done" | "fail" | "cancelled"
    exit_code: int = EXIT_OK
    reason: str = ""
    counted: bool = False  # a restart charged to resilience.max_restarts
    # A restart's short cause, the API's `elastron_job_restarts_total{cause}` label: a rank
    # cause's kind (died, raised, watchdog, peer), `error` (outside the group), or the rerun
    # state machine's move (rerun_elsewhere, node_excluded).
    cause: str = ""
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class RestartPolicy:
    """The driver's memory across attempts: restarts used, nodes avoided and excluded.

    `room(blocked_nodes) -> bool` says whether the cluster can still start the job (its minimum
    size) on nodes outside `blocked_nodes`."""

    def __init__(self, max_restarts: int, room: Callable[[set[str]], bool]):
        self.max_restarts = max_restarts
        self.room = room
        self.restarts_used = 0
        self.excluded: set[str] = set()  # persistent errors: never again in this job
        self.avoid: set[str] = set()  # the nodes of an exit 16, until the rerun is resolved

    @property
    def blocked(self) -> set[str]:
        return self.excluded | self.avoid

    def decide(self, outcome: Outcome) -> Decision:
        if outcome.succeeded:
            return Decision("done", EXIT_OK, "training finished")
        if outcome.cancelled:
            return Decision("cancelled", EXIT_CANCELLED, "cancelled")
        rerun = next((c for c in outcome.causes if c.kind == "rerun"), None)
        if rerun is not None and rerun.exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE:
            return self._resume_elsewhere(rerun, outcome)
        if rerun is not None and rerun.exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION:
            return self._validation_failed(rerun)
        storage = next((c for c in outcome.causes if c.kind == "storage"), None)
        if storage is not None:
            return Decision("fail", EXIT_FAILED, storage.message)
        return self._failure(outcome)

    def _resume_elsewhere(self, rerun: RankCause, outcome: Outcome) -> Decision:
        suspects = set(outcome.nodes)
        if not suspects or not self.room(self.excluded | suspects):
            where = ", ".join(sorted(suspects)) or "the nodes it ran on"
            return Decision(
                "fail",
                EXIT_CODE_RESUME_TO_DISAMBIGUATE,
                f"{rerun.message}; but the cluster has no room for the job outside {where}, so the result "
                "cannot be checked on other hardware (add a node and resubmit: the job resumes from its "
                "checkpoint)",
                events=[("rerun_elsewhere_impossible", {"suspect_nodes": sorted(suspects)})],
            )
        self.avoid = suspects
        return Decision(
            "restart",
            cause="rerun_elsewhere",
            reason=f"{rerun.message}: resuming from the checkpoint it just saved, away from "
            f"{len(suspects)} suspect node(s)",
            events=[("rerun_elsewhere", {"exit_code": rerun.exit_code, "avoid_nodes": sorted(suspects)})],
        )

    def _validation_failed(self, rerun: RankCause) -> Decision:
        if rerun.diagnosis == "persistent_error":
            suspects, self.avoid = set(self.avoid), set()
            self.excluded |= suspects
            events = [
                (
                    "node_excluded",
                    {"nodes": sorted(suspects), "diagnosis": rerun.diagnosis, "message": rerun.message},
                )
            ]
            if suspects and not self.room(self.excluded):
                return Decision(
                    "fail",
                    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                    f"{rerun.message}; the suspect node(s) are excluded and no room is left for the job",
                    events=events,
                )
            return Decision(
                "restart",
                cause="node_excluded",
                reason=f"{rerun.message}: excluded {len(suspects) or 'no known'} node(s), resuming",
                events=events,
            )
        return Decision(
            "fail",
            EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
            f"result validation failed ({rerun.diagnosis or 'no diagnosis'}): {rerun.message}",
        )

    def _failure(self, outcome: Outcome) -> Decision:
        self.restarts_used += 1 + outcome.restarts_spent
        left = self.max_restarts - self.restarts_used
        if left < 0:
            return Decision(
                "fail",
                EXIT_FAILED,
                f"restart budget spent (resilience.max_restarts = {self.max_restarts}); last failure: "
                f"{outcome.summary()}",
            )
        return Decision(
            "restart",
            cause=outcome.causes[0].kind if outcome.causes else "error",
            reason=f"restart {self.restarts_used} of {self.max_restarts}: {outcome.summary()}",
            counted=True,
        )
