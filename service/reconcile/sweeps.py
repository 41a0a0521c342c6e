"""Sweeps, advanced: each pass, for every running sweep, the trials' new metric values go to the
study (Optuna's pruner answers whether to stop a trial there), ended trials are told to the study,
the best trial is recorded, and new trials are drawn and recorded as queued jobs while the sweep's
budget and parallelism allow; the scheduling pass right after launches them like any job.

Crash safety. A trial is drawn from the study (Optuna's `ask`, committed in the study's storage)
before its row and its job are recorded (one store transaction), so a crash between the two leaves
a study trial without a row: the next pass adopts it (its values are in the study) and makes its
job then. A trial's row and its job are written together, so no trial gets two jobs. Telling the
study how a trial ended happens before the store records it and is skipped when the study knows
already, so a retried transaction tells nothing twice.

A pruned trial is asked to save its step and stop, as a preemption asks (its last record is then
its last checkpoint's iteration), and is cancelled rather than requeued once it has
(service/reconcile/preemption.py, `record_prune`). A trial whose drawn job spec is refused is a
failed trial, not a failed sweep. Spend is counted in rank-hours (`gpu_seconds`: a rank is a GPU;
one CPU process on a CPU cluster) from each ended trial's start to its end.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import HTTPException
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.new_jobs import record_new_job
from service.reconcile.preemption import record_prune
from service.reconcile.step import ReconcileStep
from service.scheduling.model import Node
from service.states import FINAL, JobState
from service.storage_policy import roots_for
from service.store.db import in_transaction
from service.store.jobs import add_event, get_job, new_job_id, request_cancel
from service.store.models import Sweep, SweepTrial
from service.store.sweeps import TRIAL_ACTIVE, get_sweep, metric_points, trials_of
from service.store.tokens import Principal
from service.submission import SpecProblem, accept_spec
from service.sweeps.space import grid, with_values
from service.sweeps.spec import MAX_TRIALS, SweepSpec
from service.sweeps.study import SweepStudy, study_storage

log = logging.getLogger(__name__)


def trial_job_name(sweep_name: str, number: int) -> str:
    suffix = f"-t{number}"
    return sweep_name[: 63 - len(suffix)] + suffix


def trial_limit(spec: SweepSpec) -> int:
    """Trials the sweep draws at most: its budget, and a grid's size."""
    if spec.sampler.name != "grid":
        return spec.budget.max_trials
    return min(
        spec.budget.max_trials, math.prod(len(v) for v in grid(spec.search_space, MAX_TRIALS).values())
    )


class SweepTrials(ReconcileStep):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._storage = None
        self._studies: dict[str, SweepStudy] = {}

    def study(self, sweep_id: str, spec: SweepSpec) -> SweepStudy:
        if self._storage is None:
            self._storage = study_storage(self.settings.resolved_database_url)
        study = self._studies.get(sweep_id)
        if study is None:
            study = self._studies[sweep_id] = SweepStudy.open(
                spec, sweep_id, self._storage, spec.pruner.max_resource or 1
            )
        return study

    def run_pass(self, capacity: list[Node] | None) -> None:
        with self.sessions() as s:
            running = s.scalars(
                select(Sweep.id).where(Sweep.state == "running").order_by(Sweep.created_at)
            ).all()
        for sweep_id in running:
            if self._stopping.is_set():
                return
            try:
                self.advance(sweep_id, capacity)
            except Exception as err:  # ours: logged with its trace, and said on the sweep
                log.exception("sweep %s: advancing it failed; the next pass retries", sweep_id)
                in_transaction(
                    self.sessions, lambda s, i=sweep_id, e=err: _note(s, i, f"advancing failed: {e!r}")
                )
        for gone in set(self._studies) - set(running):
            del self._studies[gone]

    def advance(self, sweep_id: str, capacity: list[Node] | None) -> None:
        with self.sessions() as s:
            sweep = get_sweep(s, sweep_id)
            spec = SweepSpec.model_validate(sweep.spec)
            cancel = sweep.cancel_requested_at is not None
        study = self.study(sweep_id, spec)
        self._adopt(sweep_id, study)
        self._hand_over_resumes(sweep_id, study)
        in_transaction(self.sessions, lambda s: self._follow_trials(s, sweep_id, spec, study, cancel))
        if not cancel:
            self._draw(sweep_id, spec, study, capacity)
        in_transaction(self.sessions, lambda s: self._conclude(s, sweep_id, spec, study))

    def _hand_over_resumes(self, sweep_id: str, study: SweepStudy) -> None:
        """An extension's pruned trials to resume, queued in the study (once per job: a crash
        before the store forgets them hands them over again, which the study ignores)."""
        with self.sessions() as s:
            pending = list(get_sweep(s, sweep_id).pending_resumes or [])
            params = {t.job_id: dict(t.params) for t in trials_of(s, sweep_id) if t.job_id in pending}
        if not pending:
            return
        for job_id in pending:
            if job_id in params:
                study.enqueue_resume(params[job_id], job_id)

        def forget(s: Session) -> None:
            sweep = get_sweep(s, sweep_id)
            sweep.pending_resumes = [j for j in (sweep.pending_resumes or []) if j not in pending] or None

        in_transaction(self.sessions, forget)

    def _adopt(self, sweep_id: str, study: SweepStudy) -> None:
        """Study trials without a row (a crash between `ask` and recording it): recorded now."""

        def adopt(s: Session) -> None:
            known = {t.number for t in trials_of(s, sweep_id)}
            for number, params in study.running_params().items():
                if number not in known:
                    s.add(_row(sweep_id, number, params, self.clock(), study.resumes(number)))

        in_transaction(self.sessions, adopt)

    def _follow_trials(
        self, s: Session, sweep_id: str, spec: SweepSpec, study: SweepStudy, cancel: bool
    ) -> None:
        sweep = get_sweep(s, sweep_id)
        now = self.clock()
        for trial in trials_of(s, sweep_id):
            if trial.state not in TRIAL_ACTIVE:
                continue
            if trial.job_id is None:  # drawn, no job yet
                if cancel:
                    _end(
                        study, sweep, trial, "failed", now, "the sweep was cancelled before its job was made"
                    )
                continue
            job = get_job(s, trial.job_id)
            for iteration, value in metric_points(
                s, job.id, spec.metric.name, after=trial.reported_iteration
            ):
                trial.reported_iteration, trial.value = iteration, value
                if trial.state == "running" and not cancel and study.report(trial.number, iteration, value):
                    reason = f"pruned by sweep {sweep_id} at iteration {iteration} ({spec.metric.name} {value:.6g})"
                    if record_prune(s, job, reason, now):
                        trial.state = "pruning"
            if cancel and job.state not in FINAL:
                request_cancel(s, job, f"sweep {sweep_id} cancelled")
            if job.state in FINAL:
                self._ended(study, sweep, trial, job, spec, now)

    def _ended(
        self, study: SweepStudy, sweep: Sweep, trial: SweepTrial, job, spec: SweepSpec, now: float
    ) -> None:
        if job.started_at is not None and job.finished_at is not None:
            ranks = sum((job.placement or {}).values()) or int((job.demand or {}).get("ranks", 1))
            sweep.gpu_seconds = (sweep.gpu_seconds or 0.0) + ranks * max(
                0.0, job.finished_at - job.started_at
            )
        if job.state == JobState.SUCCEEDED:
            if trial.value is None:
                _end(study, sweep, trial, "failed", now, f"the job reported no {spec.metric.name}")
            else:
                _end(study, sweep, trial, "complete", now)
        elif job.state == JobState.CANCELLED and job.pruned_at is not None:
            _end(study, sweep, trial, "pruned", now)
        else:
            _end(study, sweep, trial, "failed", now, job.failure_cause or f"its job ended {job.state}")

    def _draw(self, sweep_id: str, spec: SweepSpec, study: SweepStudy, capacity: list[Node] | None) -> None:
        """Make the jobs of drawn trials, then draw more while the budget and parallelism allow."""
        limit = trial_limit(spec)
        while not self._stopping.is_set():
            with self.sessions() as s:
                sweep = get_sweep(s, sweep_id)
                trials = trials_of(s, sweep_id)
                waiting = [t.number for t in trials if t.state == "waiting"]
                active = sum(1 for t in trials if t.state in TRIAL_ACTIVE)
                spent = (sweep.gpu_seconds or 0.0) / 3600
                principal = Principal(sweep.tenant, sweep.admin, f"sweep:{sweep_id}")
            if waiting:
                if not self._make_job(sweep_id, waiting[0], spec, study, principal, capacity):
                    return  # refused for now (a quota): the next pass tries again
                continue
            budget_left = spec.budget.gpu_hours is None or spent < spec.budget.gpu_hours
            if active >= spec.budget.max_parallel or study.trial_count() >= limit or not budget_left:
                return
            number, values = study.ask()
            resumes = study.resumes(number)
            in_transaction(
                self.sessions,
                lambda s, n=number, v=values, r=resumes: s.add(_row(sweep_id, n, v, self.clock(), r)),
            )

    def _make_job(
        self,
        sweep_id: str,
        number: int,
        spec: SweepSpec,
        study: SweepStudy,
        principal: Principal,
        capacity: list[Node] | None,
    ) -> bool:
        """The job of drawn trial `number`; False when it must wait (a tenant quota is full)."""
        with self.sessions() as s:
            trial = s.get(SweepTrial, (sweep_id, number))
            params, resumes = dict(trial.params), trial.resumes_job
            roots = roots_for(self.settings, s, principal)
        body = with_values(spec.base, params)
        body["name"] = trial_job_name(spec.name, number)
        if resumes is not None:  # continues a pruned trial's job from the checkpoint it saved
            body["checkpoint"] = {**(body.get("checkpoint") or {}), "resume_from": f"job:{resumes}"}
        try:
            job_spec = accept_spec(body, roots)
        except SpecProblem as err:
            self._fail_trial(sweep_id, number, study, f"its job spec was refused: {err}")
            return True
        job_id = new_job_id(body["name"])

        def record(s: Session) -> None:
            trial = s.get(SweepTrial, (sweep_id, number))
            if trial.state != "waiting":
                return
            job = record_new_job(
                s,
                job_id=job_id,
                caller=principal,
                spec=job_spec,
                roots=roots,
                settings=self.settings,
                capacity=capacity,
            )
            add_event(
                s,
                job,
                "sweep_trial",
                f"trial {number} of sweep {sweep_id}",
                data={"sweep_id": sweep_id, "number": number, "params": params},
            )
            trial.job_id, trial.state = job_id, "running"
            if (trial.message or "").startswith("waiting:"):  # the quota that held it back
                trial.message = None
            sweep = get_sweep(s, sweep_id)
            sweep.trials_started = (sweep.trials_started or 0) + 1
            sweep.updated_at = self.clock()

        try:
            in_transaction(self.sessions, record)
        except HTTPException as err:
            if err.status_code == 429:
                note = f"waiting: {err.detail}"
                in_transaction(self.sessions, lambda s: _note_trial(s, sweep_id, number, note))
                return False
            self._fail_trial(sweep_id, number, study, f"its job was refused: {err.detail}")
        return True

    def _fail_trial(self, sweep_id: str, number: int, study: SweepStudy, message: str) -> None:
        def fail(s: Session) -> None:
            trial = s.get(SweepTrial, (sweep_id, number))
            if trial.state in TRIAL_ACTIVE:
                _end(study, get_sweep(s, sweep_id), trial, "failed", self.clock(), message)

        in_transaction(self.sessions, fail)

    def _conclude(self, s: Session, sweep_id: str, spec: SweepSpec, study: SweepStudy) -> None:
        sweep = get_sweep(s, sweep_id)
        best = study.best()
        if best is not None and (sweep.best or {}).get("number") != best.number:
            row = s.get(SweepTrial, (sweep_id, best.number))
            sweep.best = {
                "number": best.number,
                "value": best.value,
                "params": best.params,
                "job_id": row.job_id if row else None,
            }
        if any(t.state in TRIAL_ACTIVE for t in trials_of(s, sweep_id)):
            return
        now = self.clock()
        if sweep.cancel_requested_at is not None:
            sweep.state, sweep.message = "cancelled", "cancelled on request"
        elif spec.budget.gpu_hours is not None and sweep.gpu_seconds / 3600 >= spec.budget.gpu_hours:
            sweep.state, sweep.message = (
                "completed",
                f"its budget of {spec.budget.gpu_hours} GPU-hours is spent",
            )
        elif study.trial_count() >= trial_limit(spec):
            sweep.state, sweep.message = "completed", f"{study.trial_count()} trials run"
        else:
            return
        sweep.finished_at = sweep.updated_at = now


def _row(
    sweep_id: str, number: int, params: dict[str, Any], now: float, resumes: str | None = None
) -> SweepTrial:
    return SweepTrial(
        sweep_id=sweep_id,
        number=number,
        params=params,
        resumes_job=resumes,
        state="waiting",
        reported_iteration=0,
        created_at=now,
        message=None if resumes is None else f"continues {resumes} from its checkpoint",
    )


def _end(
    study: SweepStudy, sweep: Sweep, trial: SweepTrial, outcome: str, now: float, message: str | None = None
) -> None:
    study.finish(trial.number, outcome, trial.value)
    trial.state, trial.finished_at = outcome, now
    if message is not None:
        trial.message = message
    sweep.updated_at = now


def _note(s: Session, sweep_id: str, message: str) -> None:
    sweep = get_sweep(s, sweep_id)
    if sweep is not None:
        sweep.message = message[:2000]


def _note_trial(s: Session, sweep_id: str, number: int, message: str) -> None:
    trial = s.get(SweepTrial, (sweep_id, number))
    if trial is not None:
        trial.message = message[:2000]
