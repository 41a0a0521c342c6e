"""The store's tables (SQLAlchemy 2 declarative).

Times are unix seconds (float) so SQLite and Postgres store and compare them the same way; the
API turns them into ISO 8601. JSON columns hold what the engine and the workers send as they
sent it (non-finite floats are turned into null first: Postgres' json type rejects NaN).

`jobs.version` is an optimistic lock: the reconciler thread, telemetry requests and cancel
requests all update job rows, and a write based on a stale read fails (and is retried) instead
of silently undoing another writer's change.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Token(Base):
    """A bearer token; only its sha256 is stored. Tokens are 256-bit random, so a fast hash suffices."""

    __tablename__ = "tokens"
    __table_args__ = (UniqueConstraint("secret_hash", name="uq_tokens_secret_hash"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public handle, e.g. tok_3f9a2c1b
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("id", name="uq_jobs_id"),
        UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
    )

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # list order, cursors
    id: Mapped[str] = mapped_column(String(96))
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # Launch: the submission id and the telemetry token's hash are written before Ray is called.
    submission_id: Mapped[str | None] = mapped_column(String(160), nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    launched_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    launch_failures: Mapped[int] = mapped_column(Integer, default=0)
    telemetry_token_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The current attempt's fencing token: one more at each launch (service/fencing.py).
    fencing_token: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    cancel_requested_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    stop_sent_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Progress, from telemetry.
    train_iters: Mapped[int] = mapped_column(Integer)
    current_iteration: Mapped[int | None] = mapped_column(Integer, nullable=True)
    iteration_epoch: Mapped[int] = mapped_column(Integer, default=0)
    last_record: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    last_progress_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    latest_checkpoint: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    failure_cause: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Counters and histograms behind the job's Prometheus series (service/metrics.py), kept
    # here so a restarted API continues them instead of resetting them.
    stats: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Scheduling (service/scheduling/): what the scheduler needs, kept on the row so a restarted
    # API rebuilds the queue from the store alone.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # Whether the scheduler may stop it for another job: scheduling.preemptible and a checkpoint
    # it resumes from (service/scheduling/demand.py).
    preemptible: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    demand: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # demand.Demand, as JSON
    queued_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # the current wait began
    waited_s: Mapped[float] = mapped_column(Float, default=0.0, server_default=text("0"))  # earlier waits
    queue_position: Mapped[int | None] = mapped_column(Integer, nullable=True)
    waiting_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    placement: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)  # ranks per node
    backfilled_for: Mapped[str | None] = mapped_column(String(96), nullable=True)
    yields_to: Mapped[str | None] = mapped_column(String(96), nullable=True)  # requeued behind this job
    preempt_requested_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    preempt_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # A resize in progress (service/reconcile/resize.py): the job is asked to save its step and stop, as
    # a preemption is, and is then launched again at once at this size and placement.
    resize_to: Mapped[int | None] = mapped_column(Integer, nullable=True)
    resize_placement: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)
    # A sweep's pruner stopped this trial (service/reconcile/sweeps.py): asked to save its step and
    # stop, as a preemption is, and then cancelled rather than requeued.
    pruned_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    version: Mapped[int] = mapped_column(Integer, nullable=False, default=1)

    __mapper_args__ = {"version_id_col": version}


class AttemptFence(Base):
    """An attempt a job left behind (service/fencing.py): its token hash, so that its telemetry is
    refused as stale (409) rather than unknown (401), and, while `watch_until` is ahead, its
    submission id, which the reconciler stops should it land late on Ray (an orphan)."""

    __tablename__ = "attempt_fences"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    fencing_token: Mapped[int] = mapped_column(Integer)
    submission_id: Mapped[str] = mapped_column(String(160))
    reason: Mapped[str] = mapped_column(String(32))  # stopped, lost, launch_lost, launch_failed
    token_hash: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    retired_at: Mapped[float] = mapped_column(Float)
    watch_until: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    stopped_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (UniqueConstraint("job_id", "dedup_key", name="uq_job_events_dedup"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    ts: Mapped[float] = mapped_column(Float)  # when it happened (the sender's clock for telemetry)
    recorded_at: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(64))
    iteration: Mapped[int | None] = mapped_column(Integer, nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Telemetry events are delivered at least once: the hash of the event's content.
    dedup_key: Mapped[str | None] = mapped_column(String(64), nullable=True)


class JobMetric(Base):
    """One engine metrics record per (job, iteration); `epoch` = the job's restart count when stored."""

    __tablename__ = "job_metrics"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    iteration: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    recorded_at: Mapped[float] = mapped_column(Float)
    record: Mapped[dict[str, Any]] = mapped_column(JSON)


class Checkpoint(Base):
    __tablename__ = "job_checkpoints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    iteration: Mapped[int | None] = mapped_column(Integer, nullable=True)
    uri: Mapped[str | None] = mapped_column(Text, nullable=True)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    result: Mapped[str] = mapped_column(String(16))  # success | failure
    ts: Mapped[float] = mapped_column(Float)


class Export(Base):
    """One export of a committed checkpoint to another format, run as its own launcher submission.

    `status`: pending (recorded; `submitted_at` null until the launcher has it) -> running ->
    succeeded | failed. `source` is where the checkpoint is read from: the location the service
    computes from the job's spec as run, not the uri the workers reported."""

    __tablename__ = "job_exports"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    iteration: Mapped[int] = mapped_column(Integer)
    format: Mapped[str] = mapped_column(String(16))
    dtype: Mapped[str] = mapped_column(String(8))
    source: Mapped[str] = mapped_column(Text)
    output: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), index=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    submission_id: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float)
    submitted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Evaluation(Base):
    """One lm-eval run (`elastron eval`) on a committed checkpoint, as its own launcher submission.

    `status`: pending (recorded; `submitted_at` null until the launcher has it) -> running ->
    succeeded | failed. `source`: the checkpoint folder the service computes from the job's spec
    as run (as an export's). `tasks` and `options` (limit, num_fewshot, ranks, tensor, pipeline)
    are what was asked; `results`: lm-eval's metrics per task, read back as JSON from the
    command's last `eval-result` line."""

    __tablename__ = "job_evals"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    iteration: Mapped[int] = mapped_column(Integer)
    source: Mapped[str] = mapped_column(Text)
    tasks: Mapped[list] = mapped_column(JSON)
    options: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)
    results: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    submission_id: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float)
    submitted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class TenantQuota(Base):
    """A tenant's limits (null: unlimited), set by an admin: what may run at once, how many jobs
    may wait, and what its jobs may ask of the scheduler."""

    __tablename__ = "tenant_quotas"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    ranks: Mapped[int | None] = mapped_column(Integer, nullable=True)
    gpus: Mapped[float | None] = mapped_column(Float, nullable=True)
    cpus: Mapped[float | None] = mapped_column(Float, nullable=True)
    queued: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_priority: Mapped[int | None] = mapped_column(Integer, nullable=True)
    allow_non_preemptible: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    updated_at: Mapped[float] = mapped_column(Float)


class TenantStorage(Base):
    """Storage roots an admin granted a tenant beyond its defaults (service/storage_policy.py)."""

    __tablename__ = "tenant_storage"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    roots: Mapped[list[str]] = mapped_column(JSON)  # read and write
    read_roots: Mapped[list[str]] = mapped_column(JSON)  # read only
    updated_at: Mapped[float] = mapped_column(Float)


class JobStorage(Base):
    """The storage roots a job was admitted with, decided at submission and handed to its
    workers at each launch (ELASTRON_STORAGE_ROOTS); `roots` null: unconfined (an admin's job)."""

    __tablename__ = "job_storage"

    job_id: Mapped[str] = mapped_column(String(96), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    roots: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class RequestLimit(Base):
    """A tenant's token bucket for one kind of request (submit, export, parse, logs), kept in the
    store so every API replica spends from the same one (service/limits.py)."""

    __tablename__ = "request_limits"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    tokens: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)  # unix seconds of the last refill


class SchedulerStats(Base):
    """The scheduler's counters and wait histogram (service/store/scheduler_stats.py), in one row
    updated in the transaction that records what they count: a restarted API continues them and
    every replica's /metrics reads the same numbers, whichever of them schedules."""

    __tablename__ = "scheduler_stats"

    key: Mapped[str] = mapped_column(String(32), primary_key=True)
    stats: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    version: Mapped[int] = mapped_column(Integer, nullable=False, default=1)

    __mapper_args__ = {"version_id_col": version}


class Sweep(Base):
    """A hyperparameter sweep (service/sweeps/): what was submitted, where it stands, and what it
    has spent. Its Optuna study is kept beside the store (service/sweeps/study.py); its trials
    are ordinary jobs, each linked by a `sweep_trials` row."""

    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(96), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    # The submitter was an admin: its trials are as unconfined as a job it submitted would be.
    admin: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    name: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # service/sweeps/spec.SweepSpec, as JSON
    state: Mapped[str] = mapped_column(String(16), index=True)  # running | completed | cancelled
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    cancel_requested_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    trials_started: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default=text("0"))  # ended trials'
    best: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # number, value, params, job_id
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    # An extension asked to resume these pruned trials' jobs (their ids), not yet handed to the study.
    pending_resumes: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    version: Mapped[int] = mapped_column(Integer, nullable=False, default=1)

    __mapper_args__ = {"version_id_col": version}


class SweepTrial(Base):
    """One trial of a sweep: its Optuna number, the values it runs with, its job (none when the
    drawn job spec was refused), and what the study was told of it."""

    __tablename__ = "sweep_trials"

    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str | None] = mapped_column(String(96), nullable=True, index=True)
    # A pruned trial's job this trial continues from its checkpoint (a sweep extended with resume_pruned).
    resumes_job: Mapped[str | None] = mapped_column(String(96), nullable=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16))  # running | complete | pruned | failed
    value: Mapped[float | None] = mapped_column(Float, nullable=True)  # the metric it ended on
    reported_iteration: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
