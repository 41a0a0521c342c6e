"""Job states and the transitions between them.

The table is the one place that says which moves are legal, so a late telemetry batch or a
stale Ray status can never move a finished job back to running: an illegal move is recorded as
an event and ignored, not applied.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"  # recorded, waiting for the scheduler (and Ray); again after a preemption
    STARTING = "starting"  # submitted to Ray, no metrics record yet
    RUNNING = "running"  # metrics records are arriving
    RESTARTING = "restarting"  # the worker group restarts (a rank or node failed)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

# -> queued from a launched state: preempted. Only the reconciler makes that move, after the
# launcher confirmed the stop it asked for (telemetry never moves a job back to queued).
ALLOWED: dict[JobState, frozenset[JobState]] = {
    # queued -> running: the API stopped between submitting and recording it, and the first
    # metrics record is how it learns the job started.
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.RESTARTING, JobState.QUEUED} | FINAL),
    JobState.RUNNING: frozenset({JobState.RESTARTING, JobState.QUEUED} | FINAL),
    JobState.RESTARTING: frozenset({JobState.RUNNING, JobState.QUEUED} | FINAL),
}


def can_move(current: str, to: str) -> bool:
    return JobState(to) in ALLOWED.get(JobState(current), frozenset())
