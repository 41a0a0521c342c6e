"""Graceful stops, sent: the launcher's `stop` for every launched job whose cancel or preemption
(a resize included) is recorded, resent while it runs on.

A cancel is stopped at once; a preempted job is first asked, in the answers to its telemetry, to
save its current step and stop by itself, and gets the launcher's stop only if it still runs after
`preempt_grace_s` (service/reconcile/preemption.py). Each job's first stop is recorded in a
`stop_sent` event; a stop is resent every 30 s until the launcher reports the job ended.

It only carries out what was recorded: it decides no cancel or preemption, and records no end
(service/reconcile/watch.py does, once the launcher confirms it).
"""

from __future__ import annotations

import logging

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from service.launcher import LauncherUnavailable
from service.reconcile.step import ReconcileStep
from service.states import FINAL, JobState
from service.store.db import in_transaction
from service.store.jobs import add_event, get_job
from service.store.models import Job

log = logging.getLogger(__name__)

_NON_FINAL = [str(s) for s in JobState if s not in FINAL]


class GracefulStops(ReconcileStep):
    def run_pass(self) -> None:
        resend_before = self.clock() - 30.0
        with self.sessions() as s:
            rows = s.execute(
                select(
                    Job.id, Job.submission_id, Job.stop_sent_at, Job.cancel_requested_at, Job.preempt_requested_at
                ).where(
                    Job.state.in_(_NON_FINAL),
                    or_(Job.cancel_requested_at.is_not(None), Job.preempt_requested_at.is_not(None)),
                    Job.submission_id.is_not(None),
                )
            ).all()
        for job_id, sid, sent_at, cancel_at, preempt_at in rows:
            if sent_at is not None and sent_at > resend_before:
                continue
            if cancel_at is None and self.clock() < preempt_at + self.settings.preempt_grace_s:
                continue  # asked to save its step and stop by itself first (telemetry answers)
            try:
                stopped = self.launcher.stop(sid)
            except LauncherUnavailable as err:
                log.warning("job %s: stop deferred: %s", job_id, err)
                return
            except Exception:
                log.exception("job %s: stopping %s failed", job_id, sid)
                continue

            def record(
                s: Session, job_id: str = job_id, first: bool = sent_at is None, stopped: bool = stopped
            ) -> None:
                job = get_job(s, job_id)
                if job is None or job.state in FINAL:
                    return
                job.stop_sent_at = self.clock()
                if first:
                    why = "" if job.cancel_requested_at is not None else f" ({job.preempt_reason})"
                    add_event(
                        s,
                        job,
                        "stop_sent",
                        f"asked {job.submission_id} to stop gracefully{why}"
                        if stopped
                        else f"{job.submission_id} had already ended",
                    )

            in_transaction(self.sessions, record)
