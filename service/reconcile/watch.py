"""What the launcher reports about each launched job, applied to the store: started, finished,
failed (with a cause worth reading), stopped as asked, vanished.

Every pass polls the submitted non-final jobs; the first pass of an API process also records, for
every non-final job, what it found (still running, finished while the API was away, vanished).
A launch intent Ray never received is dropped here and the job launched again (the ordering that
makes this safe: service/reconcile/launch.py); a job that vanished with its head node, or lost its
driver, is requeued within its budget (service/fencing.py); a job that stopped because the
scheduler asked goes back to the queue (service/reconcile/preemption.py,
service/reconcile/resize.py).

It only reads the launcher's statuses and messages: it launches and stops nothing.
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.jobspec import contract
from service import fencing
from service.launcher import LaunchStatus
from service.reconcile.preemption import requeue, stopped_pruned
from service.reconcile.resize import stopped_for_resize
from service.reconcile.step import ReconcileStep
from service.states import FINAL, JobState
from service.store.db import in_transaction
from service.store.jobs import add_event, fail, get_job, transition
from service.store.models import Job, JobEvent

log = logging.getLogger(__name__)

_NON_FINAL = [str(s) for s in JobState if s not in FINAL]
_STILL_GOING = (LaunchStatus.PENDING, LaunchStatus.RUNNING)
_EXIT_MEANING = {
    contract.EXIT_CODE_RESUME_TO_DISAMBIGUATE: "the rerun state machine needs the job resumed on other "
    f"hardware, which the cluster lacks (exit {contract.EXIT_CODE_RESUME_TO_DISAMBIGUATE})",
    contract.EXIT_CODE_FAILED_ON_RESULT_VALIDATION: "a result failed validation (rerun state machine, exit "
    f"{contract.EXIT_CODE_FAILED_ON_RESULT_VALIDATION}): see the job's diagnosis events",
}


def failure_cause(message: str | None, fallback: str, exit_code: int | None = None) -> str:
    """A one-paragraph cause: what the exit code means where the engine gave it a meaning, then
    the driver's verdict or the launcher's message (Ray's includes the last log lines)."""
    text = message or fallback
    text = text if len(text) <= 4000 else text[:2000] + "\n...\n" + text[-2000:]
    head = _EXIT_MEANING.get(exit_code) if exit_code is not None else None
    return f"{head}: {text}" if head else text


def _driver_verdict(s: Session, job_id: str) -> tuple[str | None, int | None]:
    """(reason, exit code) of the driver's job_failed event, each None where it sent none."""
    data = s.scalar(
        select(JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind == contract.EVENT_JOB_FAILED)
        .order_by(JobEvent.id.desc())
        .limit(1)
    ) or {}
    reason, code = data.get(contract.REASON), data.get(contract.EXIT_CODE)
    return (
        reason if isinstance(reason, str) and reason else None,
        code if isinstance(code, int) and not isinstance(code, bool) else None,
    )


class LaunchWatch(ReconcileStep):
    def run_pass(self, on_start: bool) -> None:
        """Poll the submitted non-final jobs and apply what the launcher reports; `on_start`: the
        first pass of this API process, which records what it found for every non-final job."""
        with self.sessions() as s:
            rows = s.execute(
                select(Job.id, Job.submission_id, Job.state)
                .where(Job.state.in_(_NON_FINAL))
                .order_by(Job.seq)
            ).all()
        if on_start:
            for job_id, sid, _ in rows:
                if sid is None:
                    self._note_on_start(job_id)
        submitted = {job_id: (sid, state) for job_id, sid, state in rows if sid is not None}
        if not submitted:
            return
        found = self.launcher.statuses(sid for sid, _ in submitted.values())
        for job_id, (sid, state) in submitted.items():
            if self._stopping.is_set():
                return
            status = found.get(sid, LaunchStatus.MISSING)
            if not on_start and status in _STILL_GOING and state != JobState.QUEUED:
                continue  # nothing to record: no transaction
            message = (
                self.launcher.message(sid) if status in (LaunchStatus.FAILED, LaunchStatus.STOPPED) else None
            )
            try:
                in_transaction(
                    self.sessions,
                    lambda s, j=job_id, i=sid, st=status, m=message: self._apply(s, j, i, st, m, on_start),
                )
            except Exception:
                log.exception("job %s: could not apply launcher status %s", job_id, status)

    def _note_on_start(self, job_id: str) -> None:
        def note(s: Session) -> None:
            job = get_job(s, job_id)
            if job is not None and job.state == JobState.QUEUED and job.submission_id is None:
                add_event(s, job, "reconciled", "API start: not launched yet, still queued")

        in_transaction(self.sessions, note)

    def _apply(
        self, s: Session, job_id: str, sid: str, status: LaunchStatus, message: str | None, on_start: bool
    ) -> None:
        job = get_job(s, job_id)
        if job is None or job.state in FINAL or job.submission_id != sid:
            return  # finished or relaunched meanwhile
        if on_start:
            add_event(
                s,
                job,
                "reconciled",
                f"API start: {self.launcher.describe()} reports {status} for {sid}",
                data={"submission_id": sid, "launcher_status": str(status)},
            )
        cancel = job.cancel_requested_at is not None
        if job.preempt_requested_at is not None and not cancel and status not in _STILL_GOING:
            # A job that saved its current step and stopped as asked ends "succeeded" short of
            # train_iters; one that really finished meanwhile is done.
            if status != LaunchStatus.SUCCEEDED or (job.current_iteration or 0) < job.train_iters:
                if job.pruned_at is not None:
                    stopped_pruned(s, job, sid, status)
                else:
                    (stopped_for_resize if job.resize_to else requeue)(s, job, sid, status, self.clock())
                return
        if status in _STILL_GOING:
            if job.state == JobState.QUEUED:
                transition(s, job, JobState.STARTING, f"submitted as {sid}")
        elif status == LaunchStatus.SUCCEEDED:
            transition(s, job, JobState.SUCCEEDED, f"{sid} finished successfully")
        elif status in (LaunchStatus.FAILED, LaunchStatus.STOPPED) and cancel:
            transition(s, job, JobState.CANCELLED, f"stopped on request ({sid} ended {status})")
        elif status == LaunchStatus.STOPPED:
            cause = failure_cause(message, f"{sid} was stopped outside elastron", self.launcher.exit_code(sid))
            fail(s, job, cause, submission_id=sid)
        elif status == LaunchStatus.FAILED:
            # The driver's own verdict (its job_failed event) says it best; Ray's message (exit
            # code and last log lines) stays in the event. No verdict and a lost driver (killed,
            # its head gone): requeued as a vanished job is (service/fencing.py).
            verdict, code = _driver_verdict(s, job.id)
            how = f"lost its driver on {self.launcher.describe()}: {(message or '')[:300]}"
            if verdict is None and fencing.driver_lost(message):
                if fencing.requeue_lost(s, job, self.settings, how, self.clock()):
                    return
            if code is None:
                code = self.launcher.exit_code(sid)
            cause = failure_cause(verdict or message, f"{sid} failed without a message", code)
            fail(s, job, cause, submission_id=sid, launcher_message=(message or "")[-4000:])
        elif status == LaunchStatus.MISSING:
            self._missing(s, job, sid, cancel)

    def _missing(self, s: Session, job: Job, sid: str, cancel: bool) -> None:
        if job.state == JobState.QUEUED:
            # An intent whose submit never reached the launcher (or is still on its way from
            # another replica: give it a few timeouts before calling it lost).
            if self.clock() - (job.launched_at or 0) < 3 * self.settings.ray_timeout_s:
                return
            if cancel:
                transition(s, job, JobState.CANCELLED, "cancelled before the launch reached Ray")
                return
            add_event(
                s, job, "launch_lost", f"{sid} never reached {self.launcher.describe()}; launching again"
            )
            # Should it land late after all, it is an orphan: fenced, and stopped once seen.
            fencing.retire(s, job, fencing.LAUNCH_LOST, self.clock(), watch=True)
            job.submission_id = None
            job.telemetry_token_hash = None
            job.placement = None
            job.queued_at = self.clock()
            return
        if cancel:
            transition(s, job, JobState.CANCELLED, f"stopped on request ({sid} is gone)")
            return
        how = f"vanished from {self.launcher.describe()} (its head node was lost or restarted)"
        if fencing.requeue_lost(s, job, self.settings, how, self.clock()):
            return
        fail(
            s,
            job,
            f"the launched job {sid} vanished from {self.launcher.describe()} (the cluster restarted or its "
            f"record was deleted) more often than its budget of {fencing.lost_budget(job, self.settings)} "
            "requeues (ELASTRON_LOST_JOB_REQUEUES, or resilience.max_restarts if larger); submit it again "
            "(it resumes from its latest checkpoint with checkpoint.resume: auto, or use "
            "checkpoint.resume_from)",
            submission_id=sid,
        )
