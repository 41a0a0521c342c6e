"""Attempt fencing: a job attempt the control plane has given up on can neither report nor save.

Why: a Ray submission that timed out may still land later, and a head node that lost its job
table may leave ranks running; such an orphan attempt would train on into the same checkpoint
folder as the attempt that replaced it. Each launch therefore gives the job a new fencing token
(`jobs.fencing_token`, one more each time, passed to the Ray job as ELASTRON_FENCING_TOKEN) and a
new job token; when the reconciler drops an attempt (`retire`), its token hash and submission id
go to `attempt_fences`. Then:
- telemetry with a retired attempt's job token is refused with 409 and the code
  `attempt_fenced` (service/routers/telemetry.py), not the 401 of an unknown token: the workers
  (workers/telemetry.py) stop that attempt at once, exiting non-zero before any further
  checkpoint is committed (workers/fencing.py);
- an attempt retired without Ray confirming its end (its launch was lost, refused, or the whole
  Ray job vanished) is watched for `WATCH_S`: should its submission show up on Ray, the
  reconciler stops it (`stop_orphans`), with an `orphan_stopped` event on the job.

A vanished attempt (a head node lost with every job on it) is also where a job is queued again
rather than failed: `lost_budget` says how many times.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.launcher import Launcher, LaunchStatus
from service.settings import Settings
from service.store.db import in_transaction
from service.store.jobs import add_event, get_job
from service.store.models import AttemptFence, Job

log = logging.getLogger(__name__)

WATCH_S = 3600.0  # how long a retired submission that Ray never confirmed ended is watched
RESTOP_S = 30.0  # a watched orphan still running is asked to stop again after this long
STOPPED, LOST, LAUNCH_LOST, LAUNCH_FAILED = "stopped", "lost", "launch_lost", "launch_failed"


def next_token(job: Job) -> int:
    """The fencing token of the attempt being launched: one more than any before it."""
    job.fencing_token = (job.fencing_token or 0) + 1
    return job.fencing_token


def retire(s: Session, job: Job, reason: str, now: float, *, watch: bool) -> None:
    """The job's current attempt is over for the control plane: fence its token, and with `watch`
    (Ray did not confirm its end) stop its submission should it appear on Ray."""
    if job.submission_id is None:
        return
    s.add(
        AttemptFence(
            job_id=job.id,
            fencing_token=job.fencing_token or 0,
            submission_id=job.submission_id,
            reason=reason,
            token_hash=job.telemetry_token_hash,
            retired_at=now,
            watch_until=now + WATCH_S if watch else None,
        )
    )
    job.telemetry_token_hash = None


def stale_attempt(s: Session, job_id: str, token_hash: str) -> AttemptFence | None:
    """The retired attempt this job token was made for, if any."""
    return s.scalars(
        select(AttemptFence)
        .where(AttemptFence.job_id == job_id, AttemptFence.token_hash == token_hash)
        .order_by(AttemptFence.id.desc())
        .limit(1)
    ).first()


def lost_budget(job: Job, settings: Settings) -> int:
    """How many vanished attempts a job survives: its resilience.max_restarts or the operator's
    `lost_job_requeues`, whichever is larger."""
    resilience = (job.spec or {}).get("resilience") or {}
    try:
        own = int(resilience.get("max_restarts") or 0)
    except (TypeError, ValueError):
        own = 0
    return max(own, settings.lost_job_requeues)


def times_lost(s: Session, job_id: str) -> int:
    return (
        s.scalar(
            select(func.count())
            .select_from(AttemptFence)
            .where(AttemptFence.job_id == job_id, AttemptFence.reason == LOST)
        )
        or 0
    )


class OrphanWatch:
    """Asks Ray about the watched retired submissions every `every_s` (not every reconcile pass:
    one status call each), and stops those that run."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        launcher: Launcher,
        clock: Callable[[], float],
        every_s: float,
    ):
        self.sessions, self.launcher, self.clock, self.every_s = sessions, launcher, clock, every_s
        self.checked_at: float | None = None

    def run_pass(self) -> None:
        now = self.clock()
        if self.checked_at is not None and now - self.checked_at < self.every_s:
            return
        stop_orphans(self.sessions, self.launcher, self.clock)
        self.checked_at = now


def stop_orphans(sessions: sessionmaker[Session], launcher: Launcher, clock: Callable[[], float]) -> None:
    """One pass over the watched retired submissions: stop those Ray runs, forget those that
    ended or whose watch is over. LauncherUnavailable propagates (the pass is cut short)."""
    with sessions() as s:
        rows = s.execute(
            select(AttemptFence.id, AttemptFence.submission_id, AttemptFence.stopped_at).where(
                AttemptFence.watch_until.is_not(None)
            )
        ).all()
    if not rows:
        return
    found = launcher.statuses(sid for _, sid, _ in rows)
    now = clock()
    for fence_id, sid, stopped_at in rows:
        status = found.get(sid, LaunchStatus.MISSING)
        stop = status in (LaunchStatus.PENDING, LaunchStatus.RUNNING) and (
            stopped_at is None or now - stopped_at >= RESTOP_S
        )
        if stop:
            launcher.stop(sid)
        in_transaction(sessions, lambda s, f=fence_id, st=status, stop=stop: _record(s, f, st, stop, now))


def _record(s: Session, fence_id: int, status: LaunchStatus, stopped: bool, now: float) -> None:
    fence = s.get(AttemptFence, fence_id)
    if fence is None or fence.watch_until is None:
        return
    if stopped:
        first = fence.stopped_at is None
        fence.stopped_at = now
        job = get_job(s, fence.job_id)
        if first and job is not None:
            add_event(
                s,
                job,
                "orphan_stopped",
                f"{fence.submission_id} (attempt with fencing token {fence.fencing_token}, given up on: "
                f"{fence.reason}) turned up {status} on Ray; asked it to stop. Its telemetry is refused "
                "and its ranks exit without saving",
                data={
                    "submission_id": fence.submission_id,
                    "fencing_token": fence.fencing_token,
                    "launcher_status": str(status),
                },
            )
    elif (
        status in (LaunchStatus.SUCCEEDED, LaunchStatus.FAILED, LaunchStatus.STOPPED)
        or now >= fence.watch_until
    ):
        fence.watch_until = None  # ended, or never showed up: nothing left to watch


# Ray's words for a driver that did not end by itself (no verdict of its own): its process was
# killed (SIGKILL: an OOM killer), or the job supervisor actor or its node died with the head.
_DRIVER_LOST = re.compile(
    r"exit code (-9|137)\b|supervisor actor (died|could not be scheduled)|actor died unexpectedly"
    r"|node (died|was terminated|is dead)|out of memory|\bOOM\b",
    re.IGNORECASE,
)


def driver_lost(message: str | None) -> bool:
    """Whether Ray's message for a failed Ray job says its driver was lost rather than failed."""
    return bool(message) and _DRIVER_LOST.search(message) is not None


def requeue_lost(s: Session, job: Job, settings: Settings, how: str, now: float) -> bool:
    """A launched job's Ray job vanished (a head node lost, and its job table with it) or lost its
    driver (`how` says which): queue it again, to resume from its newest checkpoint with a new
    attempt and fencing token, while its budget lasts (`lost_budget`); False when it is spent
    (the caller fails the job)."""
    from service.states import JobState
    from service.store.jobs import transition

    sid, lost, budget = job.submission_id, times_lost(s, job.id), lost_budget(job, settings)
    if sid is None or lost >= budget:
        return False
    latest = (job.latest_checkpoint or {}).get("iteration")
    what = f"{sid} {how}; queued again ({lost + 1} of {budget} such requeues), to resume from " + (
        f"the checkpoint of iteration {latest}" if latest is not None else "its newest checkpoint"
    )
    transition(s, job, JobState.QUEUED, what, submission_id=sid)
    add_event(
        s,
        job,
        "attempt_lost",
        what,
        data={
            "submission_id": sid,
            "fencing_token": job.fencing_token,
            "requeues": lost + 1,
            "budget": budget,
            "resume_iteration": latest,
        },
    )
    retire(s, job, LOST, now, watch=True)
    job.submission_id = job.stop_sent_at = job.preempt_requested_at = None
    job.placement = job.backfilled_for = job.resize_to = job.resize_placement = None
    job.queued_at = now
    return True
