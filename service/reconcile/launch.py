"""Launches: one queued job taken to the launcher, in an order that makes a crash at any point
safe; and, when the launcher cannot tell the cluster's capacity, the queue launched oldest first.

The ordering: a launch writes its submission id, attempt, fencing token and telemetry token hash
(an intent) and commits *before* calling Ray. After a crash the next pass finds the intent and
asks Ray about that submission id (service/reconcile/watch.py): found -> the job is starting;
missing (the call never reached Ray) -> the intent is dropped and the job is launched again with a
fresh id and token. A launch the launcher refuses is retried up to `max_launch_attempts` times,
each refused attempt retired (fenced) in case it lands after all (service/fencing.py).

It launches the jobs it is handed, at the size and placement it is handed: who is admitted where
is the scheduler's call (service/reconcile/scheduling_pass.py). Its calls to Ray run in the
reconcile loop's worker thread, never in a request.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service import fencing
from service.launcher import LauncherUnavailable, worker_env
from service.reconcile.step import ReconcileStep
from service.scheduling.demand import Demand, launch_size, sized_spec, trim_placement
from service.scheduling.model import Admission
from service.states import JobState
from service.storage_policy import launch_env
from service.store import scheduler_stats
from service.store.db import in_transaction
from service.store.jobs import add_event, fail, get_job, transition
from service.store.models import Job
from service.store.tokens import JOB_PREFIX, hash_secret, new_secret

log = logging.getLogger(__name__)


class Launching(ReconcileStep):
    def oldest_first(self) -> bool:
        """The cluster's capacity unknown: the queued jobs oldest first, `dispatch_batch` per pass,
        as Ray Jobs queues them itself. False when the launcher became unavailable."""
        with self.sessions() as s:
            ids = s.scalars(
                select(Job.id)
                .where(
                    Job.state == JobState.QUEUED,
                    Job.submission_id.is_(None),
                    Job.cancel_requested_at.is_(None),
                )
                .order_by(Job.seq)
                .limit(self.settings.dispatch_batch)
            ).all()
        for job_id in ids:
            if self._stopping.is_set():
                return True
            if not self.launch(job_id):
                return False
        return True

    def launch(
        self, job_id: str, admission: Admission | None = None, demand: Demand | None = None, resized: bool = False
    ) -> bool:
        """Launch one job; False when the launcher became unavailable (stop dispatching). With an
        admission: at its size and placement, recorded in an `admitted` event and its wait in the
        wait-time histogram (service/store/scheduler_stats.py), in the same transaction.
        `resized`: a resized job's relaunch, which was not waiting in the queue (no admission, no
        wait counted)."""
        token = new_secret(JOB_PREFIX)

        def intent(s: Session) -> tuple[str, dict[str, Any], dict[str, int] | None, int] | None:
            job = get_job(s, job_id)
            if job is None or job.state != JobState.QUEUED or job.submission_id or job.cancel_requested_at:
                return None
            now = self.clock()
            job.attempt += 1
            sid = f"elastron-{job.id}-{job.attempt}"
            job.submission_id, job.launched_at = sid, now
            job.telemetry_token_hash = hash_secret(token)
            fence = fencing.next_token(job)
            spec = job.spec
            if resized and admission is not None and demand is not None:
                size = launch_size(demand, admission.ranks)
                job.placement = trim_placement(admission.placement, size)
                job.resize_to = job.resize_placement = job.queue_position = job.waiting_reason = None
                spec = sized_spec(job.spec, demand, size)
            elif admission is not None and demand is not None:
                size = launch_size(demand, admission.ranks)
                placement = trim_placement(admission.placement, size)
                waited = max(0.0, now - (job.queued_at if job.queued_at is not None else job.created_at))
                job.waited_s = (job.waited_s or 0.0) + waited
                scheduler_stats.observe_wait(s, job.tenant, job.priority or 0, waited)
                job.placement, job.backfilled_for = placement, admission.backfilled_for
                job.queue_position = job.waiting_reason = job.yields_to = None
                spec = sized_spec(job.spec, demand, size)
                add_event(
                    s,
                    job,
                    "admitted",
                    f"admitted on {size} ranks: "
                    + ", ".join(f"{k} on {node}" for node, k in sorted(placement.items()))
                    + (f" (backfilled ahead of {admission.backfilled_for})" if admission.backfilled_for else "")
                    + f", after {waited:.0f} s queued",
                    data={
                        "ranks": size,
                        "placement": placement,
                        "backfilled_for": admission.backfilled_for,
                        "waited_s": waited,
                    },
                )
            add_event(
                s,
                job,
                "launch",
                f"submitting to {self.launcher.describe()} as {sid}",
                data={"submission_id": sid, "attempt": job.attempt, "fencing_token": fence},
            )
            return sid, spec, job.placement, fence

        claimed = in_transaction(self.sessions, intent)
        if claimed is None:
            return True
        sid, spec, placement, fence = claimed
        spec_json = json.dumps(spec, separators=(",", ":"))
        env = worker_env(job_id, spec_json, self.settings.api_url, token, placement, fencing_token=fence)
        with self.sessions() as s:  # the roots it was admitted with, its tenant's credentials
            env.update(launch_env(self.settings, s, job_id))
        try:
            self.launcher.submit(job_id, spec_json, env, submission_id=sid)
        except LauncherUnavailable as err:
            # Unknown whether it arrived: the intent stays and the next pass asks about `sid`.
            log.warning("job %s: launch of %s deferred: %s", job_id, sid, err)
            return False
        except Exception as err:
            log.exception("job %s: launching %s failed", job_id, sid)
            in_transaction(self.sessions, lambda s, e=err: self._launch_failed(s, job_id, sid, e))
            return True

        def started(s: Session) -> None:
            job = get_job(s, job_id)
            if job is not None and job.submission_id == sid and job.state == JobState.QUEUED:
                transition(s, job, JobState.STARTING, f"submitted as {sid}")

        in_transaction(self.sessions, started)
        return True

    def _launch_failed(self, s: Session, job_id: str, sid: str, err: Exception) -> None:
        job = get_job(s, job_id)
        if job is None or job.submission_id != sid or job.state != JobState.QUEUED:
            return
        job.launch_failures += 1
        fencing.retire(s, job, fencing.LAUNCH_FAILED, self.clock(), watch=True)
        job.submission_id = None
        job.telemetry_token_hash = None
        job.placement = None
        job.queued_at = self.clock()
        add_event(
            s,
            job,
            "launch_failed",
            f"{self.launcher.describe()} refused {sid}: {err}",
            data={"submission_id": sid, "error": str(err), "error_type": type(err).__name__},
        )
        if job.launch_failures >= self.settings.max_launch_attempts:
            fail(s, job, f"could not launch after {job.launch_failures} attempts; last error: {err}")
