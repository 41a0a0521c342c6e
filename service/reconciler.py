"""The background loop between the store and the launcher: launch, watch, stop.

Every pass (every `reconcile_interval_s`, or sooner when a request nudges it):
1. ask whether the launcher (Ray) is reachable; if not, stop here: queued jobs wait, running
   jobs keep their last known state, and /readyz says why;
2. once per API process, before anything else: reconcile every non-final job with Ray and
   record what was found (still running, finished while the API was away, vanished);
3. poll the submitted non-final jobs and apply what Ray reports;
4. send stop requests for jobs whose cancel (or preemption) was recorded;
5. launch queued jobs: when the launcher reports the cluster's capacity, the scheduler's pure
   core (service/scheduling/core.py) decides who is admitted where, who is preempted, and each
   waiting job's position and reason (`_schedule`); when it cannot tell, oldest first,
   `dispatch_batch` per pass, as Ray Jobs queues them itself;
6. checkpoint exports (service/export_runs.py): submit the recorded ones as their own Ray jobs
   with resource requests, poll the unfinished ones and record how they ended.
Between 3 and 5, retired attempts that Ray never confirmed ended are watched and stopped should
they show up (service/fencing.py: fencing tokens, orphan attempts, lost jobs requeued).

Ordering that makes a crash at any point safe: a launch writes its submission id, attempt and
telemetry token hash (an intent) and commits *before* calling Ray. After a crash the next pass
finds the intent and asks Ray about that submission id: found -> the job is starting; missing
(the call never reached Ray) -> the intent is dropped and the job is launched again with a
fresh id and token. Ray calls run in a worker thread, never in a request.

A preemption is recorded first (`preempt_requested_at`); the job hears it in the answers to its
telemetry and saves a checkpoint of its current step before it stops (nothing lost:
engine/train_loop.py, RankHooks.should_stop); one still running after `preempt_grace_s` gets
the launcher's graceful `stop`, as a cancel does. When the launcher confirms that the job
ended (a job that stopped as asked ends "succeeded" short of train_iters), it goes back to `queued`
(a `preempted` event) with a fresh submission to come, and resumes from its newest checkpoint
(`checkpoint.resume: auto`; only such jobs are preemptible, service/scheduling/demand.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import bindparam, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from service import fencing
from service.export_runs import ExportRuns
from service.launcher import Launcher, LauncherUnavailable, LaunchStatus, worker_env
from service.metrics import SchedulerMetrics
from service.scheduling.core import Admission, Node, Policy, Resize, decide
from service.scheduling.demand import Demand, launch_size, sized_spec, trim_placement
from service.scheduling.lease import SchedulerLease
from service.scheduling.state import read_inputs
from service.settings import Settings
from service.states import FINAL, JobState
from service.storage_policy import launch_env
from service.store import scheduler_stats
from service.store import stats as job_stats
from service.store.db import in_transaction
from service.store.jobs import add_event, fail, get_job, transition
from service.store.models import Job, JobEvent
from service.store.tokens import JOB_PREFIX, hash_secret, new_secret

log = logging.getLogger(__name__)

_NON_FINAL = [str(s) for s in JobState if s not in FINAL]
_STILL_GOING = (LaunchStatus.PENDING, LaunchStatus.RUNNING)
_EXIT_CODE = re.compile(r"exit code (-?\d+)")
_EXIT_MEANING = {
    16: "the rerun state machine needs the job resumed on other hardware, which the cluster lacks (exit 16)",
    17: "a result failed validation (rerun state machine, exit 17): see the job's diagnosis events",
}


def failure_cause(message: str | None, fallback: str) -> str:
    """A one-paragraph cause from the launcher's message (Ray's includes the last log lines)."""
    if not message:
        return fallback
    match = _EXIT_CODE.search(message)
    head = _EXIT_MEANING.get(int(match.group(1))) if match else None
    text = message if len(message) <= 4000 else message[:2000] + "\n...\n" + message[-2000:]
    return f"{head}: {text}" if head else text


def _driver_reason(s: Session, job_id: str) -> str | None:
    data = s.scalar(
        select(JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind == "job_failed")
        .order_by(JobEvent.id.desc())
        .limit(1)
    )
    reason = (data or {}).get("reason")
    return reason if isinstance(reason, str) and reason else None


class Reconciler:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        launcher: Launcher,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        metrics: SchedulerMetrics | None = None,
    ):
        self.sessions, self.launcher, self.settings, self.clock = sessions, launcher, settings, clock
        self.metrics = metrics
        # The cluster as last read (None: unknown): the scheduler's and the submission check's.
        self.capacity: list[Node] | None = None
        self.capacity_at: float | None = None
        self.allocated: tuple[float, float] = (0.0, 0.0)  # CPUs, GPUs given to launched jobs
        # Elastic jobs are admitted at a size in [min_ranks, ranks], shrunk to make room and grown
        # back into free room: each resize is a save of the current step, a stop and a launch at
        # the new size (`_record_resize`).
        self.policy = Policy(aging_s=settings.scheduler_aging_s)
        self.lease = SchedulerLease(sessions.kw["bind"])
        self._demands: dict[str, Demand] = {}  # job id -> its demand (read_inputs' cache)
        self.ray_reachable: bool | None = None  # None: not checked yet
        self.ray_checked_at: float | None = None
        self.reconciled_on_start = False
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._tick_lock = threading.Lock()
        self.exports = ExportRuns(sessions, launcher, settings, self.clock, self._stopping)
        # Retired attempts Ray never confirmed ended: stopped should they turn up (orphans).
        self.orphans = fencing.OrphanWatch(sessions, launcher, self.clock, 10 * settings.reconcile_interval_s)

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        while not self._stopping.is_set():
            try:
                await asyncio.to_thread(self.tick)
            except Exception:
                log.exception("reconcile pass failed; the next pass retries")
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.reconcile_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()

    def stop(self) -> None:
        self._stopping.set()
        self.nudge()
        # A pass in flight launches nothing more once _stopping is set.
        self.lease.release()

    def nudge(self) -> None:
        """Run a pass soon (after a submission or a cancel); safe from any thread."""
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    def tick(self) -> None:
        with self._tick_lock:
            if not self._check_launcher():
                return
            try:
                if not self.reconciled_on_start:
                    self._poll(on_start=True)
                    self.reconciled_on_start = True
                else:
                    self._poll(on_start=False)
                self._send_stops()
                self.orphans.run_pass()
                self._dispatch()
                self.exports.run_pass()
            except LauncherUnavailable as err:  # Ray went away during the pass: try again later
                self.ray_reachable = False
                log.warning("reconcile pass cut short: %s", err)

    def _check_launcher(self) -> bool:
        ok = self.launcher.reachable()
        if ok != self.ray_reachable:
            (log.info if ok else log.warning)(
                "%s is %s", self.launcher.describe(), "reachable" if ok else "unreachable: queued jobs wait"
            )
        self.ray_reachable, self.ray_checked_at = ok, self.clock()
        return ok

    # -- watch ------------------------------------------------------------------------------

    def _poll(self, on_start: bool) -> None:
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
                (self._stopped_for_resize if job.resize_to else self._requeue)(s, job, sid, status)
                return
        if status in _STILL_GOING:
            if job.state == JobState.QUEUED:
                transition(s, job, JobState.STARTING, f"submitted as {sid}")
        elif status == LaunchStatus.SUCCEEDED:
            transition(s, job, JobState.SUCCEEDED, f"{sid} finished successfully")
        elif status in (LaunchStatus.FAILED, LaunchStatus.STOPPED) and cancel:
            transition(s, job, JobState.CANCELLED, f"stopped on request ({sid} ended {status})")
        elif status == LaunchStatus.STOPPED:
            fail(s, job, failure_cause(message, f"{sid} was stopped outside elastron"), submission_id=sid)
        elif status == LaunchStatus.FAILED:
            # The driver's own verdict (its job_failed event) says it best; Ray's message (exit
            # code and last log lines) stays in the event. No verdict and a lost driver (killed,
            # its head gone): requeued as a vanished job is (service/fencing.py).
            verdict = _driver_reason(s, job.id)
            how = f"lost its driver on {self.launcher.describe()}: {(message or '')[:300]}"
            if verdict is None and fencing.driver_lost(message):
                if fencing.requeue_lost(s, job, self.settings, how, self.clock()):
                    return
            cause = verdict or failure_cause(message, f"{sid} failed without a message")
            fail(s, job, cause, submission_id=sid, launcher_message=(message or "")[-4000:])
        elif status == LaunchStatus.MISSING:
            self._missing(s, job, sid, cancel)

    def _requeue(self, s: Session, job: Job, sid: str, status: LaunchStatus) -> None:
        """A preempted job's stop is confirmed: back to the queue, to resume from its newest
        checkpoint with its next launch."""
        reason = job.preempt_reason or "preempted"
        self._stopped_as_asked(s, job, sid, status, "preempted", "preemptions", f"{reason}; back in the queue", {})
        job.backfilled_for = None
        job.queued_at = self.clock()

    def _stopped_for_resize(self, s: Session, job: Job, sid: str, status: LaunchStatus) -> None:
        """A resized job saved its step and stopped: queued for a moment, holding the room of its
        new size (service/scheduling/state.py counts it as running), and launched at that size by
        the next scheduling pass, ahead of every queued job (`_schedule`)."""
        data = {
            "from_ranks": sum((job.placement or {}).values()) or None,
            "to_ranks": job.resize_to,
            "placement": job.resize_placement,
        }
        what = f"{job.preempt_reason}; relaunching on {job.resize_to} ranks"
        self._stopped_as_asked(s, job, sid, status, "resized", "resizes", what, data)
        job.queue_position, job.waiting_reason = None, f"resizing: relaunching on {job.resize_to} ranks"

    def _stopped_as_asked(
        self, s: Session, job: Job, sid: str, status: LaunchStatus, kind: str, stat: str, what: str, data: dict
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
        fencing.retire(s, job, fencing.STOPPED, self.clock(), watch=False)
        job.submission_id = job.telemetry_token_hash = job.stop_sent_at = job.preempt_requested_at = None
        job.placement = None

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

    # -- stop -------------------------------------------------------------------------------

    def _send_stops(self) -> None:
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

    # -- launch -----------------------------------------------------------------------------

    def _dispatch(self) -> None:
        try:
            nodes = self.launcher.capacity()
        except LauncherUnavailable as err:
            # Not knowing the cluster this pass is no reason to hand Ray jobs that may not fit:
            # nothing is launched until the next pass reads it.
            log.warning("cluster capacity unknown this pass, no job launched: %s", err)
            return
        self.capacity, self.capacity_at = nodes, self.clock()
        if nodes is not None:
            if self.lease.held():  # else another API replica schedules
                self._schedule(nodes)
            return
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
            if self._stopping.is_set() or not self._launch(job_id):
                return

    def _schedule(self, nodes: list[Node]) -> None:
        """One scheduling pass: the core's decision on the store's state, applied. Waiting jobs'
        positions and reasons are written only when they changed (this runs every pass);
        preemptions are recorded, then sent as graceful stops; admissions are launched."""
        now = self.clock()
        with self.sessions() as s:
            inputs = read_inputs(s, nodes, self._demands)
        for job_id, (ranks, placement) in inputs.relaunch.items():  # resized: their room is held
            if self._stopping.is_set():
                return
            if not self._launch(job_id, Admission(job_id, ranks, placement), inputs.demands[job_id], resized=True):
                return
        decision = decide(nodes, inputs.running, inputs.queued, inputs.quotas, now, self.policy, inputs.stopping)
        decision.resize = [z for z in decision.resize if self._may_resize(z, inputs, now)]
        alive = [n for n in nodes if n.alive]
        capacity = (sum(n.cpus for n in alive), sum(n.gpus for n in alive))
        held = [(r.ranks, r.job.shape) for r in inputs.running]
        shapes = {j.id: j.shape for j in inputs.queued}
        held += [(a.ranks, shapes[a.job_id]) for a in decision.admit[: self.settings.dispatch_batch]]
        self.allocated = (sum(k * sh.cpus for k, sh in held), sum(k * sh.gpus for k, sh in held))
        if self.metrics is not None:
            self.metrics.cluster(capacity, self.allocated)
        batch = self.settings.dispatch_batch
        shown = {job_id: (w.position, w.reason[:4000]) for job_id, w in decision.waiting.items()}
        for a in decision.admit[batch:]:  # admitted, launched in a later pass (dispatch_batch)
            shown[a.job_id] = (None, "admitted: launching")
        changed = [
            {"job_id": job_id, "position": pos, "reason": reason}
            for job_id, (pos, reason) in shown.items()
            if inputs.shown.get(job_id) != (pos, reason)
        ]
        if changed:
            # Plain UPDATEs, not ORM writes: advisory fields that must not bump the row's version
            # (a telemetry write racing with this would otherwise be retried for nothing).
            stmt = (
                update(Job)
                .where(Job.id == bindparam("job_id"), Job.state == JobState.QUEUED.value)
                .values(queue_position=bindparam("position"), waiting_reason=bindparam("reason"))
            )
            in_transaction(self.sessions, lambda s: s.connection().execute(stmt, changed))
        for p in decision.preempt:
            in_transaction(self.sessions, lambda s, p=p: self._record_preemption(s, p.job_id, p.reason, p))
        for z in decision.resize:
            in_transaction(self.sessions, lambda s, z=z: self._record_resize(s, z))
        if decision.preempt or decision.resize:
            self._send_stops()
        for admission in decision.admit[: self.settings.dispatch_batch]:
            if self._stopping.is_set():
                return
            if not self._launch(admission.job_id, admission, inputs.demands[admission.job_id]):
                return

    def _may_resize(self, z: Resize, inputs: Any, now: float) -> bool:
        """Shrinks always go ahead (a job waits for their room); a grow costs the job a stop and a
        restart, so it waits until the job has run `scheduler_grow_after_s` at its size."""
        if z.ranks < sum(inputs.placements.get(z.job_id, {}).values()):
            return True
        return now - inputs.launched_at.get(z.job_id, now) >= self.settings.scheduler_grow_after_s

    def _record_resize(self, s: Session, z: Resize) -> None:
        """Ask a running elastic job to save its step and stop, to be launched again at once at
        its new size (a preemption's request, then `_stopped_for_resize`). A grow takes its new
        room now (read_inputs counts the larger of both placements), so nothing else is admitted
        into it while the job restarts."""
        job = get_job(s, z.job_id)
        if job is None or job.state in FINAL or job.submission_id is None or job.preempt_requested_at:
            return
        old = dict(job.placement or {})
        scheduler_stats.count(
            s, "resizes", job.tenant, job.priority or 0, "grow" if z.ranks > sum(old.values()) else "shrink"
        )
        job.preempt_requested_at = self.clock()
        job.preempt_reason = z.reason
        job.resize_to, job.resize_placement = z.ranks, dict(z.placement)
        add_event(
            s,
            job,
            "resizing",
            f"{z.reason}: asking {job.submission_id} to save its step and stop, to go on with "
            f"{z.ranks} ranks instead of {sum(old.values())}",
            data={"from_ranks": sum(old.values()), "to_ranks": z.ranks, "placement": z.placement},
        )

    def _record_preemption(self, s: Session, job_id: str, reason: str, p: Any) -> None:
        job = get_job(s, job_id)
        if job is None or job.state in FINAL or job.submission_id is None or job.preempt_requested_at:
            return
        job.preempt_requested_at = self.clock()
        job.preempt_reason = reason
        job.yields_to = p.for_job if p.reclaimed else None
        scheduler_stats.count(s, "preemptions", job.tenant, job.priority or 0)
        add_event(
            s,
            job,
            "preempting",
            f"{reason}: asking {job.submission_id} to stop gracefully; it goes back to the queue",
            data={"for_job": p.for_job, "reclaimed": p.reclaimed, "submission_id": job.submission_id},
        )

    def _launch(
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
            self.ray_reachable = False
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
