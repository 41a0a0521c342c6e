"""A preemption carried out in the store: the request recorded, and the job back in the queue once
the launcher confirms it stopped.

A preemption is recorded first (`preempt_requested_at`); the job hears it in the answers to its
telemetry and saves a checkpoint of its current step before it stops (nothing lost:
engine/train_loop.py, RankHooks.should_stop); one still running after `preempt_grace_s` gets
the launcher's graceful `stop`, as a cancel does (service/reconcile/stops.py). When the launcher
confirms that the job ended (a job that stopped as asked ends "succeeded" short of train_iters:
service/reconcile/watch.py), it goes back to `queued` (a `preempted` event) with a fresh
submission to come, and resumes from its newest checkpoint (`checkpoint.resume: auto`; only such
jobs are preemptible, service/scheduling/demand.py). A resize is a preemption followed by a
launch at the new size (service/reconcile/resize.py), so it ends the same way
(`stopped_as_asked`).

Store writes only, inside the caller's transaction: it chooses no victim (the scheduler does:
service/scheduling/victims.py) and never calls the launcher.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service import fencing
from service.launcher import LaunchStatus
from service.scheduling.model import Preemption
from service.states import FINAL, JobState
from service.store import scheduler_stats
from service.store import stats as job_stats
from service.store.jobs import add_event, get_job, transition
from service.store.models import Job


def record_preemption(s: Session, p: Preemption, now: float) -> None:
    """Ask a running job to save its step and stop (it hears it in its telemetry's answers), to
    make room for `p.for_job`."""
    job = get_job(s, p.job_id)
    if job is None or job.state in FINAL or job.submission_id is None or job.preempt_requested_at:
        return
    job.preempt_requested_at = now
    job.preempt_reason = p.reason
    job.yields_to = p.for_job if p.reclaimed else None
    # A live resize in flight (resize_to alone) is superseded: the job stops and is requeued, not
    # relaunched at that size.
    job.resize_to = job.resize_placement = None
    scheduler_stats.count(s, "preemptions", job.tenant, job.priority or 0)
    add_event(
        s,
        job,
        "preempting",
        f"{p.reason}: asking {job.submission_id} to stop gracefully; it goes back to the queue",
        data={"for_job": p.for_job, "reclaimed": p.reclaimed, "submission_id": job.submission_id},
    )


def requeue(s: Session, job: Job, sid: str, status: LaunchStatus, now: float) -> None:
    """A preempted job's stop is confirmed: back to the queue, to resume from its newest
    checkpoint with its next launch."""
    reason = job.preempt_reason or "preempted"
    stopped_as_asked(s, job, sid, status, "preempted", "preemptions", f"{reason}; back in the queue", {}, now)
    job.backfilled_for = None
    job.queued_at = now


def stopped_as_asked(
    s: Session,
    job: Job,
    sid: str,
    status: LaunchStatus,
    kind: str,
    stat: str,
    what: str,
    data: dict,
    now: float,
) -> None:
    """A job the scheduler asked to stop has ended: back to `queued` without a submission,
    and an event (`kind`) saying which checkpoint it resumes from."""
    latest = (job.latest_checkpoint or {}).get("iteration")
    transition(s, job, JobState.QUEUED, what, submission_id=sid)
    add_event(
        s,
        job,
        kind,
        f"{sid} stopped ({status}): {what}; resumes from "
        + (f"the checkpoint of iteration {latest}" if latest is not None else "its newest checkpoint"),
        data={
            "submission_id": sid,
            "launcher_status": str(status),
            **data,
            "stopped_at_iteration": job.current_iteration,
            "resume_iteration": latest,
        },
    )
    edited = job_stats.editable(job.stats)
    job_stats.count(edited, stat, "stopped")
    job.stats = edited
    fencing.retire(s, job, fencing.STOPPED, now, watch=False)
    job.submission_id = job.telemetry_token_hash = job.stop_sent_at = job.preempt_requested_at = None
    job.placement = None


def record_prune(s: Session, job: Job, reason: str, now: float) -> bool:
    """Stop a trial its sweep's pruner stopped (service/reconcile/sweeps.py): asked to save its
    step and stop as a preempted job is (so its last record is its last checkpoint's iteration),
    then cancelled, not requeued (`stopped_pruned`); one not launched yet is cancelled at once.
    Its checkpoint stays, so a longer sweep can resume it (`checkpoint.resume_from: job:ID`)."""
    if job.state in FINAL or job.pruned_at is not None:
        return False
    job.pruned_at = now
    if job.submission_id is None:
        add_event(s, job, "pruned", f"{reason}; it had not started")
        transition(s, job, JobState.CANCELLED, f"pruned before launch: {reason}")
        return True
    job.preempt_requested_at = now
    job.preempt_reason = reason
    add_event(
        s,
        job,
        "pruning",
        f"{reason}: asking {job.submission_id} to save its step and stop",
        data={"submission_id": job.submission_id, "iteration": job.current_iteration},
    )
    return True


def stopped_pruned(s: Session, job: Job, sid: str, status: LaunchStatus) -> None:
    """A pruned trial's stop is confirmed: cancelled, with the checkpoint it saved."""
    latest = (job.latest_checkpoint or {}).get("iteration")
    add_event(
        s,
        job,
        "pruned",
        f"{sid} stopped ({status}) at iteration {job.current_iteration}, checkpoint of iteration {latest}",
        data={
            "submission_id": sid,
            "launcher_status": str(status),
            "stopped_at_iteration": job.current_iteration,
            "checkpoint_iteration": latest,
        },
    )
    transition(s, job, JobState.CANCELLED, f"pruned by its sweep: {job.preempt_reason}", submission_id=sid)
    job.preempt_requested_at = None
