"""What the job driver records about its job, and where that goes.

The control plane learns how a job runs from the driver's events: that it started, each attempt,
why an attempt failed, what the restart policy decided, where the ranks were placed, and how the
job ended (the kinds and fields: workers/README.md, "Telemetry"). Each one is queued on the
driver's telemetry sender (workers/telemetry.py: batched, spooled while the control plane is
away; a fenced driver exits at once, workers/fencing.py) and printed as `[elastron] event {...}`
on stdout, the Ray Jobs log (service/log_lines.py shortens those lines for the CLI). The driver
(workers/driver.py) decides; this module holds what each decision says, in one place.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from engine.jobspec import JobSpec, contract
from workers.fencing import exit_fenced
from workers.policy import Decision, Outcome, RestartPolicy
from workers.telemetry import TelemetrySender

# How a job's end is named, by the action that ended it (any other: the job failed).
END_KINDS = {"done": "job_succeeded", "cancelled": "job_cancelled"}


class DriverEvents:
    """The events of one job's driver: sent to the control plane, printed on the job's log."""

    def __init__(self, job_id: str, flush_interval_s: float) -> None:
        self.sender = TelemetrySender.from_env(
            job_id,
            "driver",
            flush_interval_s=flush_interval_s,
            event_defaults={"job_id": job_id},
            on_fenced=exit_fenced,  # a newer attempt runs: this one ends now (workers/fencing.py)
        )

    def start(self) -> None:
        self.sender.start()

    def event(self, kind: str, **fields: Any) -> None:
        ev = self.sender.event(kind, **fields)
        print(f"[elastron] event {json.dumps(ev, default=str)}", flush=True)

    def job_started(self, spec: JobSpec, sizes: list[int], checkpoint_path: str, device: str) -> None:
        r = spec.resources
        self.event(
            "job_started",
            ranks=r.ranks,
            sizes=sizes,
            elastic=r.elastic,
            max_restarts=spec.resilience.max_restarts,
            checkpoint_path=checkpoint_path,
            device=device,
        )

    def attempt_started(self, attempt: int, policy: RestartPolicy) -> None:
        self.event(
            "attempt_started",
            attempt=attempt,
            excluded_nodes=sorted(policy.excluded),
            avoid_nodes=sorted(policy.avoid),
        )

    def attempt_failed(self, attempt: int, started: float, outcome: Outcome) -> None:
        """`started`: when the attempt began (time.time())."""
        self.event(
            "attempt_failed",
            attempt=attempt,
            seconds=round(time.time() - started, 3),
            causes=[c.to_json() for c in outcome.causes],
            error=outcome.error,
            summary=outcome.summary(),
        )

    def decided(self, attempt: int, decision: Decision, policy: RestartPolicy) -> None:
        """The policy's own events for the attempt (rerun elsewhere, a node excluded), then the
        restart it decided on, if any (under the next attempt's number)."""
        for kind, fields in decision.events:
            self.event(kind, attempt=attempt, **fields)
        if decision.action == "restart":
            self.event(
                contract.EVENT_RESTART,
                attempt=attempt + 1,
                **{contract.EVENT_CAUSE: decision.cause, contract.REASON: decision.reason},
                counted=decision.counted,
                restarts_used=policy.restarts_used,
                max_restarts=policy.max_restarts,
            )

    def placement_scheduled(self, attempt: int, placement: dict[str, int]) -> None:
        self.event("placement_scheduled", attempt=attempt, placement=placement)

    def placement_sticky(self, attempt: int, selectors: list[dict[str, str]]) -> None:
        self.event("placement_sticky", attempt=attempt, nodes=[s.get("ray.io/node-id") for s in selectors])

    def job_ended(self, action: str, **result: Any) -> None:
        """The job's last event: `result` is the driver's JobResult, as fields."""
        self.event(END_KINDS.get(action, contract.EVENT_JOB_FAILED), **result)

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is left; what the control plane did not take stays in the spool, said on
        stderr."""
        if not self.sender.close(timeout_s) and self.sender.enabled:
            print(
                f"[elastron] the control plane did not take all telemetry ({self.sender.last_error}); "
                f"the rest is spooled in {self.sender.spool_path}",
                file=sys.stderr,
                flush=True,
            )
