"""Prometheus exposition: the job series of service/METRICS.md and the API's request metrics.

Job series are read from the store at scrape time with two queries (the jobs shown, and the
count per state), never one per job: every number they need is on the job row (`last_record`,
and `stats` for counters and histograms, service/store/stats.py). So a scrape costs the same
with one API replica or several, and after an API restart the counters continue instead of
dropping to zero. Shown: every non-final job, and final jobs for `metrics_retention_s` after
they finished.

They are written straight to the text format (one pass over the rows, label strings built once
per job) rather than through prometheus_client's metric families: with ~30 series per job that
is several times cheaper per scrape. The request metrics are ordinary prometheus_client
metrics in the app's own registry.
"""

from __future__ import annotations

import math
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy import func, literal, or_, select, union_all
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.states import JobState
from service.store import scheduler_stats
from service.store import stats as job_stats
from service.store.models import Evaluation, Job, Sweep, SweepTrial
from service.store.sweeps import SWEEP_STATES, TRIAL_STATES

_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
# Gauges read from the last metrics record: (metric name, record field, help).
_RECORD_GAUGES = (
    ("elastron_job_loss", "loss", "Training loss of the last iteration."),
    ("elastron_job_learning_rate", "lr", "Learning rate of the last iteration."),
    ("elastron_job_grad_norm", "grad_norm", "Global gradient norm of the last iteration."),
    ("elastron_job_loss_scale", "loss_scale", "fp16 dynamic loss scale."),
    ("elastron_job_tokens_per_second", "tokens_per_s", "Tokens per second of the last iteration."),
    ("elastron_job_mfu_ratio", "mfu", "Model FLOPs utilisation of the last iteration, 0..1."),
    ("elastron_job_power_watts", "power_w", "Average power of the job's devices in the last iteration."),
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _label(v: Any) -> str:
    return str(v).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Family:
    __slots__ = ("name", "kind", "doc", "lines")

    def __init__(self, name: str, kind: str, doc: str):
        self.name, self.kind, self.doc, self.lines = name, kind, doc, []

    def add(self, labels: str, value: float, suffix: str = "") -> None:
        self.lines.append(f"{self.name}{suffix}{{{labels}}} {_value(value)}")

    def histogram(self, labels: str, hist: dict[str, Any], bounds: tuple[float, ...]) -> None:
        for le, n in job_stats.cumulative_buckets(hist, bounds):
            self.lines.append(f'{self.name}_bucket{{{labels},le="{le}"}} {_value(n)}')
        self.add(labels, hist["count"], "_count")
        self.add(labels, hist["sum"], "_sum")

    def text(self) -> str:
        head = f"# HELP {self.name} {self.doc}\n# TYPE {self.name} {self.kind}\n"
        return head + "".join(line + "\n" for line in self.lines)


class JobSeries:
    """Renders the job series of METRICS.md from the store."""

    def __init__(self, sessions: sessionmaker[Session], retention_s: float, clock=time.time):
        self.sessions, self.retention_s, self.clock = sessions, retention_s, clock

    def _read(self) -> tuple[list[Any], dict[str, int]]:
        cutoff = self.clock() - self.retention_s
        with self.sessions() as s:
            rows = s.execute(
                select(
                    Job.id,
                    Job.tenant,
                    Job.state,
                    Job.train_iters,
                    Job.current_iteration,
                    Job.last_progress_at,
                    Job.last_record,
                    Job.stats,
                ).where(or_(Job.finished_at.is_(None), Job.finished_at >= cutoff))
            ).all()
            # Counts per state, and per tenant and priority for the queue's gauge: one query whose
            # size grows with tenants and priority levels, never with jobs.
            groups = s.execute(
                select(Job.state, Job.tenant, Job.priority, func.count()).group_by(
                    Job.state, Job.tenant, Job.priority
                )
            ).all()
            scheduler = scheduler_stats.read(s)
            sweeps = _sweep_counts(s, cutoff)
            scores = _eval_scores(s, cutoff)
        counts: dict[str, int] = {}
        queue = []
        for state, tenant, priority, n in groups:
            counts[state] = counts.get(state, 0) + n
            if state == JobState.QUEUED.value:
                queue.append((tenant, priority, n))
        return rows, counts, queue, scheduler, sweeps, scores

    def render(self) -> str:
        rows, counts, queue, scheduler, sweeps, scores = self._read()
        jobs = _Family("elastron_jobs", "gauge", "Jobs in each state.")
        for state in JobState:
            jobs.add(f'state="{state.value}"', counts.get(state.value, 0))
        queued = _Family("elastron_queue_jobs", "gauge", "Jobs waiting in the queue, per tenant and priority.")
        for tenant, priority, n in queue:
            queued.add(f'tenant="{_label(tenant)}",priority="{priority or 0}"', n)
        state = _Family("elastron_job_state", "gauge", "1, labelled with the job's current state.")
        transitions = _Family(
            "elastron_job_state_transitions_total", "counter", "Transitions into each state."
        )
        iteration = _Family("elastron_job_iteration", "gauge", "Last iteration reported.")
        train_iters = _Family("elastron_job_train_iterations", "gauge", "training.train_iters of the job.")
        progress = _Family(
            "elastron_job_last_progress_timestamp_seconds", "gauge", "Unix time of the last iteration record."
        )
        record_gauges = [(_Family(name, "gauge", doc), field) for name, field, doc in _RECORD_GAUGES]
        valid = _Family("elastron_job_validation_loss", "gauge", "Last validation loss.")
        skipped = _Family(
            "elastron_job_skipped_iterations_total", "counter", "Iterations skipped on fp16 overflow."
        )
        tokens = _Family("elastron_job_tokens_total", "counter", "Tokens trained.")
        energy = _Family(
            "elastron_job_energy_joules_total",
            "counter",
            "Energy of the job's devices (absent when unavailable).",
        )
        phases = _Family("elastron_job_phase_seconds", "gauge", "Engine timers, min/max over ranks.")
        restarts = _Family("elastron_job_restarts_total", "counter", "Worker-group restarts.")
        reruns = _Family("elastron_job_rerun_events_total", "counter", "Rerun state machine diagnoses.")
        recoveries = _Family(
            "elastron_job_recoveries_total",
            "counter",
            "Resumes after a restart, by where the state came from.",
        )
        steps_lost = _Family("elastron_job_steps_lost_total", "counter", "Steps re-executed after restarts.")
        recovery_s = _Family(
            "elastron_job_recovery_phase_seconds", "gauge", "Phases of the last restart's resume."
        )
        replicas_lost = _Family(
            "elastron_job_replicas_lost_total", "counter", "replace_replica: steps taken without a failed replica began."
        )
        replicas_rejoined = _Family(
            "elastron_job_replicas_rejoined_total", "counter", "replace_replica: replaced replicas back in the quorum."
        )
        survivor_stall = _Family(
            "elastron_job_survivor_stall_seconds", "gauge", "replace_replica: the survivors' last stall over a step."
        )
        rejoin_s = _Family(
            "elastron_job_replica_rejoin_seconds", "gauge", "replace_replica: the last replica's time out of the quorum."
        )
        checkpoints = _Family("elastron_job_checkpoints_total", "counter", "Checkpoint saves.")
        ckpt_retries = _Family(
            "elastron_job_checkpoint_retries_total", "counter", "Checkpoint save attempts retried after a storage error."
        )
        ckpt_bytes = _Family(
            "elastron_job_checkpoint_bytes", "gauge", "Size of the last committed checkpoint."
        )
        rank_step = _Family(
            "elastron_job_rank_step_seconds", "gauge", "Each rank's forward-backward time in the last logged step."
        )
        rank_slowness = _Family(
            "elastron_job_rank_slowness_ratio", "gauge", "Each rank's time over the median rank's, averaged."
        )
        straggling = _Family("elastron_job_stragglers", "gauge", "Ranks flagged as stragglers now.")
        step = _Family("elastron_job_step_seconds", "histogram", "Step time.")
        ckpt_save = _Family(
            "elastron_job_checkpoint_save_seconds", "histogram", "Time a checkpoint save took."
        )

        for job_id, tenant, job_state, iters, current, progress_at, record, stats in rows:
            base = f'job="{_label(job_id)}",tenant="{_label(tenant)}"'
            stats, record = stats or {}, record or {}
            state.add(f'{base},state="{job_state}"', 1.0)  # the current state only: one series per job
            for s, n in (stats.get("transitions") or {}).items():
                transitions.add(f'{base},state="{_label(s)}"', n)
            train_iters.add(base, iters)
            if current is not None:
                iteration.add(base, current)
            if progress_at is not None:
                progress.add(base, progress_at)
            for family, field in record_gauges:
                value = _number(record.get(field))
                if value is not None:
                    family.add(base, value)
            if _number(stats.get("valid_loss")) is not None:
                valid.add(base, stats["valid_loss"])
            skipped.add(base, stats.get("skipped", 0))
            tokens.add(base, stats.get("tokens", 0))
            if "energy_j" in stats:
                energy.add(base, stats["energy_j"])
            for phase, pair in (stats.get("timers") or {}).items():
                if isinstance(pair, list) and len(pair) == 2:
                    for stat, value in zip(("min", "max"), pair, strict=True):
                        if _number(value) is not None:
                            phases.add(f'{base},phase="{_label(phase)}",stat="{stat}"', value)
            for cause, n in (stats.get("restarts") or {}).items():
                restarts.add(f'{base},cause="{_label(cause)}"', n)
            for diagnosis, n in (stats.get("reruns") or {}).items():
                reruns.add(f'{base},diagnosis="{_label(diagnosis)}"', n)
            for source, n in (stats.get("recoveries") or {}).items():
                recoveries.add(f'{base},recovered_from="{_label(source)}"', n)
            if stats.get("recoveries"):
                steps_lost.add(base, stats.get("steps_lost", 0))
            for phase, value in (stats.get("recovery_s") or {}).items():
                if _number(value) is not None:
                    recovery_s.add(f'{base},phase="{_label(phase)}"', value)
            replicas_lost.add(base, stats.get("replicas_lost", 0))
            replicas_rejoined.add(base, stats.get("replicas_rejoined", 0))
            for family, key in ((survivor_stall, "survivor_stall_s"), (rejoin_s, "rejoin_s")):
                if _number(stats.get(key)) is not None:
                    family.add(base, stats[key])
            for result in ("success", "failure"):
                checkpoints.add(f'{base},result="{result}"', (stats.get("checkpoints") or {}).get(result, 0))
            ckpt_retries.add(base, stats.get("ckpt_retries", 0))
            if _number(stats.get("ckpt_bytes")) is not None:
                ckpt_bytes.add(base, stats["ckpt_bytes"])
            for family, key in ((rank_step, "rank_step_s"), (rank_slowness, "rank_slowness")):
                for rank, value in enumerate(stats.get(key) or []):
                    if _number(value) is not None:
                        family.add(f'{base},rank="{rank}"', value)
            if stats.get("rank_slowness"):
                straggling.add(base, len(stats.get("stragglers") or []))
            if stats.get("step"):  # histograms are absent until their first observation
                step.histogram(base, stats["step"], job_stats.STEP_BUCKETS)
            if stats.get("ckpt_save"):
                ckpt_save.histogram(base, stats["ckpt_save"], job_stats.CHECKPOINT_BUCKETS)

        families = (
            jobs,
            queued,
            state,
            transitions,
            iteration,
            train_iters,
            progress,
            *(f for f, _ in record_gauges),
            valid,
            skipped,
            tokens,
            energy,
            phases,
            restarts,
            reruns,
            recoveries,
            steps_lost,
            recovery_s,
            replicas_lost,
            replicas_rejoined,
            survivor_stall,
            rejoin_s,
            checkpoints,
            ckpt_retries,
            ckpt_bytes,
            rank_step,
            rank_slowness,
            straggling,
            step,
            ckpt_save,
        )
        return (
            "".join(f.text() for f in families) + _scheduler_text(scheduler) + _sweep_text(*sweeps) + _eval_text(scores)
        )


def _sweep_counts(s: Session, cutoff: float) -> tuple[dict[str, int], dict[str, int]]:
    """Sweeps per state, and their trials per state: the running sweeps and those that ended
    within the retention (one query, grouped: its size does not grow with trials)."""
    recent = or_(Sweep.finished_at.is_(None), Sweep.finished_at >= cutoff)
    sweeps = select(literal("sweep"), Sweep.state, func.count()).where(recent).group_by(Sweep.state)
    trials = (
        select(literal("trial"), SweepTrial.state, func.count())
        .join(Sweep, Sweep.id == SweepTrial.sweep_id)
        .where(recent)
        .group_by(SweepTrial.state)
    )
    counts: dict[str, dict[str, int]] = {"sweep": {}, "trial": {}}
    for kind, state, n in s.execute(union_all(sweeps, trials)).all():
        counts[kind][state] = n
    return counts["sweep"], counts["trial"]


def _eval_scores(s: Session, cutoff: float) -> list[tuple[str, str, int, dict]]:
    """(job, tenant, iteration, scores) of each job's newest succeeded evaluation, for the jobs
    running or ended within the retention (one row per job: its size does not grow with
    checkpoints)."""
    recent = or_(Job.finished_at.is_(None), Job.finished_at >= cutoff)
    newest = (
        select(Evaluation.job_id, func.max(Evaluation.iteration).label("iteration"))
        .join(Job, Job.id == Evaluation.job_id)
        .where(recent, Evaluation.status == "succeeded")
        .group_by(Evaluation.job_id)
        .subquery()
    )
    rows = s.execute(
        select(Evaluation.job_id, Job.tenant, Evaluation.iteration, Evaluation.results, Evaluation.finished_at)
        .join(Job, Job.id == Evaluation.job_id)
        .join(newest, (newest.c.job_id == Evaluation.job_id) & (newest.c.iteration == Evaluation.iteration))
        .where(Evaluation.status == "succeeded")
        .order_by(Evaluation.finished_at)
    ).all()
    found: dict[str, tuple[str, str, int, dict]] = {}
    for job_id, tenant, iteration, results, _ in rows:  # several at that iteration: the last to finish
        merged = {**(found[job_id][3] if job_id in found else {}), **(results or {})}
        found[job_id] = (job_id, tenant, iteration, merged)
    return list(found.values())


def _eval_text(scores: list[tuple[str, str, int, dict]]) -> str:
    score = _Family("elastron_job_eval_score", "gauge", "The newest evaluated checkpoint's lm-eval scores.")
    at = _Family("elastron_job_eval_iteration", "gauge", "The iteration of the newest evaluated checkpoint.")
    for job_id, tenant, iteration, results in scores:
        labels = f'job="{_label(job_id)}",tenant="{_label(tenant)}"'
        at.add(labels, iteration)
        for task, metrics in sorted(results.items()):
            for metric, value in sorted((metrics or {}).items()):
                number = _number(value)
                if number is not None:
                    score.add(f'{labels},task="{_label(task)}",metric="{_label(metric)}"', number)
    return score.text() + at.text()


def _sweep_text(sweeps: dict[str, int], trials: dict[str, int]) -> str:
    families = []
    for name, doc, counts, states in (
        ("elastron_sweeps", "Sweeps in each state.", sweeps, SWEEP_STATES),
        ("elastron_sweep_trials", "Trials of those sweeps in each state.", trials, TRIAL_STATES),
    ):
        family = _Family(name, "gauge", doc)
        for state in states:
            family.add(f'state="{state}"', counts.get(state, 0))
        families.append(family)
    return "".join(f.text() for f in families)


def _scheduler_text(stats: dict[str, Any]) -> str:
    """The scheduler's series (service/store/scheduler_stats.py); labels in alphabetical order."""
    wait = _Family(
        "elastron_queue_wait_seconds", "histogram", "Time a job waited in the queue before it was admitted (each admission)."
    )
    for (tenant, priority), hist in scheduler_stats.labelled(stats.get("wait")):
        wait.histogram(f'priority="{_label(priority)}",tenant="{_label(tenant)}"', hist, scheduler_stats.WAIT_BUCKETS)
    preemptions = _Family(
        "elastron_preemptions_total",
        "counter",
        "Jobs the scheduler stopped to make room for another, by the stopped job's tenant and priority.",
    )
    for (tenant, priority), n in scheduler_stats.labelled(stats.get("preemptions")):
        preemptions.add(f'priority="{_label(priority)}",tenant="{_label(tenant)}"', n)
    resizes = _Family(
        "elastron_resizes_total",
        "counter",
        "Running elastic jobs the scheduler resized (a save, a stop, a launch at the new size), by direction.",
    )
    for (tenant, priority, direction), n in scheduler_stats.labelled(stats.get("resizes")):
        resizes.add(f'direction="{_label(direction)}",priority="{_label(priority)}",tenant="{_label(tenant)}"', n)
    return "".join(f.text() for f in (wait, preemptions, resizes))


class SchedulerMetrics:
    """The cluster's capacity against what the scheduler has allocated, as its last pass read and
    counted them (absent until the capacity is known): gauges in the app's registry, set again by
    every pass. The scheduler's counters and wait histogram are in the store (JobSeries renders
    them); the queue's length is read from the store too."""

    def __init__(self, registry: CollectorRegistry):
        self.capacity = Gauge(
            "elastron_cluster_capacity",
            "CPUs and GPUs of the cluster's alive nodes (the scheduler's last read).",
            ["resource"],
            registry=registry,
        )
        self.allocated = Gauge(
            "elastron_cluster_allocated",
            "CPUs and GPUs the scheduler has given to launched jobs.",
            ["resource"],
            registry=registry,
        )

    def cluster(self, capacity: tuple[float, float], allocated: tuple[float, float]) -> None:
        for resource, total, used in zip(("cpu", "gpu"), capacity, allocated, strict=True):
            self.capacity.labels(resource).set(total)
            self.allocated.labels(resource).set(used)


class HttpMetrics:
    """ASGI middleware: request count and latency by method, route template and status."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry):
        self.app = app
        self.requests = Counter(
            "elastron_http_requests",
            "HTTP requests served.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "elastron_http_request_duration_seconds",
            "HTTP request latency.",
            ["method", "route"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            route = (
                getattr(scope.get("route"), "path", None) or "<unmatched>"
            )  # the template, never the raw path
            method = scope["method"] if scope["method"] in _METHODS else "OTHER"
            self.requests.labels(method, route, str(status)).inc()
            self.latency.labels(method, route).observe(time.perf_counter() - start)
