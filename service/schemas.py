"""Request and response bodies of the REST API (the job specification itself is engine/jobspec/)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.jobspec import ParallelSpec
from engine.jobspec.layout import describe
from service import progress
from service.states import JobState
from service.store.models import Checkpoint, Export, Job, JobEvent
from service.store.telemetry import number

log = logging.getLogger(__name__)


def stored_time(ts: float | None) -> datetime | None:
    """A stored unix time as a datetime; None (and a log line) for one no datetime can hold, which
    rows written before telemetry was bounded may carry: a bad row must not make a job unreadable."""
    if ts is None:
        return None
    try:
        return datetime.fromtimestamp(ts, UTC)
    except (OverflowError, OSError, ValueError):
        log.warning("stored timestamp %r is out of range: served as null", ts)
        return None


class Problem(BaseModel):
    """Error body: `detail` says what is wrong and how to fix it."""

    detail: str | list[dict[str, Any]]


class CheckpointOut(BaseModel):
    iteration: int | None
    uri: str | None
    bytes: int | None
    seconds: float | None
    result: str = "success"
    time: datetime | None

    @classmethod
    def from_row(cls, row: Checkpoint) -> CheckpointOut:
        return cls(
            iteration=row.iteration,
            uri=row.uri,
            bytes=row.bytes,
            seconds=row.seconds,
            result=row.result,
            time=stored_time(row.ts),
        )

    @classmethod
    def from_latest(cls, latest: dict[str, Any] | None) -> CheckpointOut | None:
        if not latest:
            return None
        return cls(
            iteration=latest.get("iteration"),
            uri=latest.get("uri"),
            bytes=latest.get("bytes"),
            seconds=latest.get("seconds"),
            time=stored_time(latest.get("ts")),
        )


class JobSummary(BaseModel):
    id: str
    name: str
    tenant: str
    state: JobState
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    iteration: int | None = Field(description="The last iteration reported by the workers.")
    train_iters: int
    restarts: int
    ranks: int | None = Field(None, description="resources.ranks of the spec as run.")
    layout: str | None = Field(None, description="The parallel layout, e.g. 'tp2 pp1 cp1 dp1'.")
    loss: float | None = Field(None, description="Training loss of the newest metrics record.")
    tokens_per_s: float | None = Field(None, description="Throughput of the newest metrics record.")
    mfu: float | None = Field(None, description="Model FLOPs utilisation of the newest record, 0..1.")
    priority: int = Field(0, description="scheduling.priority of the spec as run.")
    queue_position: int | None = Field(
        None, description="While queued: 1 = next in the scheduler's order (null when not queued or not scheduled yet)."
    )
    waiting_reason: str | None = Field(
        None, description="While queued: why it waits, e.g. 'needs 4 ranks x (1 CPU, 1 GPU), 2 free'."
    )
    progress: float | None = Field(
        None, description="iteration / train_iters, 0..1; null before the first metrics record."
    )
    eta_s: float | None = Field(
        None,
        description="While running: seconds to train_iters at the mean of the last 20 step times "
        "(checkpoint saves and restarts not included); null otherwise.",
    )
    restart_s: float = Field(0.0, description="Seconds the job has spent restarting its worker group so far.")

    @classmethod
    def from_row(cls, job: Job, stats: dict[str, Any] | None = None) -> JobSummary:
        """`stats`: the part of job.stats the list read (else the row's own column is read)."""
        return cls(**_summary_fields(job, stats))


def _layout(spec: dict[str, Any] | None) -> tuple[int | None, str | None]:
    """(ranks, 'tpT ppP cpC dpD') from a stored spec; (None, None) for one that lacks them."""
    try:
        ranks = int(spec["resources"]["ranks"])
        p = ParallelSpec.model_validate(spec["parallel"])
    except (KeyError, TypeError, ValueError):
        return None, None
    return ranks, describe(ranks, p)


def _summary_fields(job: Job, stats: dict[str, Any] | None = None) -> dict[str, Any]:
    ranks, layout = _layout(job.spec)
    last = job.last_record or {}
    return {
        "id": job.id,
        "name": job.name,
        "tenant": job.tenant,
        "state": JobState(job.state),
        "created_at": stored_time(job.created_at),
        "updated_at": stored_time(job.updated_at),
        "started_at": stored_time(job.started_at),
        "finished_at": stored_time(job.finished_at),
        "iteration": job.current_iteration,
        "train_iters": job.train_iters,
        "restarts": job.restarts,
        "ranks": ranks,
        "layout": layout,
        "loss": number(last.get("loss")),
        "tokens_per_s": number(last.get("tokens_per_s")),
        "mfu": number(last.get("mfu")),
        "priority": job.priority or 0,
        "queue_position": job.queue_position if job.state == JobState.QUEUED else None,
        "waiting_reason": job.waiting_reason if job.state == JobState.QUEUED else None,
        **progress.fields(job.state, job.current_iteration, job.train_iters, job.stats if stats is None else stats),
    }


class JobOut(JobSummary):
    spec: dict[str, Any] = Field(description="The job specification as it runs (defaults filled in).")
    last_metrics: dict[str, Any] | None = Field(description="The newest metrics record.")
    last_progress_at: datetime | None
    latest_checkpoint: CheckpointOut | None
    failure_cause: str | None
    cancel_requested_at: datetime | None
    submission_id: str | None = Field(description="The Ray job's submission id of the current attempt.")
    attempt: int
    rank_step_s: list[float] | None = Field(
        None, description="Each rank's forward-backward seconds in the last logged step (rank order)."
    )
    rank_slowness: list[float] | None = Field(
        None, description="Each rank's time over the median rank's, averaged over about the last 10 logged steps."
    )
    stragglers: list[int] = Field(
        default_factory=list, description="Ranks slower than the median by more than 25 % (service/stragglers.py)."
    )

    @classmethod
    def from_row(cls, job: Job) -> JobOut:
        stats = job.stats or {}
        return cls(
            **_summary_fields(job),
            spec=job.spec,
            last_metrics=job.last_record,
            last_progress_at=stored_time(job.last_progress_at),
            latest_checkpoint=CheckpointOut.from_latest(job.latest_checkpoint),
            failure_cause=job.failure_cause,
            cancel_requested_at=stored_time(job.cancel_requested_at),
            submission_id=job.submission_id,
            attempt=job.attempt,
            rank_step_s=stats.get("rank_step_s"),
            rank_slowness=stats.get("rank_slowness"),
            stragglers=stats.get("stragglers") or [],
        )


class JobList(BaseModel):
    jobs: list[JobSummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class EventOut(BaseModel):
    id: int
    time: datetime | None = Field(description="When it happened; null only for an unreadable stored time.")
    kind: str = Field(description="state, launch, reconciled, restart, diagnosis, checkpoint_saved, ...")
    iteration: int | None
    message: str | None
    data: dict[str, Any]

    @classmethod
    def from_row(cls, row: JobEvent) -> EventOut:
        return cls(
            id=row.id,
            time=stored_time(row.ts),
            kind=row.kind,
            iteration=row.iteration,
            message=row.message,
            data=row.data or {},
        )


class EventList(BaseModel):
    events: list[EventOut]
    next_after: int | None = Field(description="Pass as `after` for the next page; null on the last page.")


class MetricsPage(BaseModel):
    records: list[dict[str, Any]] = Field(description="Engine metrics records, by iteration (README).")
    next_after: int | None = Field(description="Pass as `after` for the next page; null on the last page.")


class CheckpointList(BaseModel):
    checkpoints: list[CheckpointOut]


class QueueEntry(BaseModel):
    position: int | None = Field(description="1 = next; null until the scheduler's first pass over it.")
    id: str
    name: str
    tenant: str
    priority: int
    ranks: int | None
    waiting_reason: str | None
    queued_since: datetime | None = Field(description="When its current wait began.")
    waited_s: float = Field(description="Seconds queued so far, this wait and earlier ones (a preempted job's).")


class ClusterUse(BaseModel):
    nodes: int = Field(description="Alive nodes.")
    cpus: float
    gpus: float
    allocated_cpus: float = Field(description="Given to launched jobs by the scheduler's accounting.")
    allocated_gpus: float
    read_at: datetime | None


class QueueOut(BaseModel):
    jobs: list[QueueEntry] = Field(description="Waiting jobs in the scheduler's order.")
    cluster: ClusterUse | None = Field(description="The capacity the scheduler last read; null: unknown (no scheduling).")


class QuotaIn(BaseModel):
    """A tenant's limits; null (or absent): unlimited."""

    model_config = ConfigDict(extra="forbid")

    ranks: int | None = Field(None, ge=0, le=2**31 - 1, description="Ranks running at once.")
    gpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False, description="GPUs running at once.")
    cpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False, description="CPUs running at once.")
    queued: int | None = Field(None, ge=0, le=2**31 - 1, description="Jobs waiting at once (more: 429).")
    max_priority: int | None = Field(
        None, ge=-1000, le=1000, description="The highest scheduling.priority its jobs may ask for."
    )
    allow_non_preemptible: bool = Field(False, description="Whether its jobs may set scheduling.preemptible: false.")


class QuotaOut(QuotaIn):
    tenant: str
    updated_at: datetime | None


class ExportIn(BaseModel):
    """What to export a committed checkpoint to."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["hf", "peft", "hf-merged-lora"] = Field(
        "hf",
        description="hf: a Hugging Face model folder (config.json, safetensors); for a LoRA job (model.lora): "
        "peft, its adapters as a PEFT folder (adapter_config.json, adapter_model.safetensors), or "
        "hf-merged-lora, its base with the adapters merged in (`elastron export --format hf --merge-lora`).",
    )
    output: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Where to write the folder: an s3:// URI, or an absolute local path under "
        "<ELASTRON_CHECKPOINT_DIR>/<tenant>/ (when that is local) or <ELASTRON_HOME>/exports/<tenant>/. "
        "Default: beside the checkpoint, <the checkpoint's folder>-<format>, e.g. .../iter_0000100-hf.",
    )
    dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="The weights' dtype in the export.")

    @field_validator("output")
    @classmethod
    def _plain_text(cls, value: str | None) -> str | None:
        if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("output must not contain control characters")
        return value


ExportStatus = Literal["pending", "running", "succeeded", "failed"]


class ExportOut(BaseModel):
    id: str
    job_id: str
    iteration: int
    format: str
    dtype: str
    checkpoint: str = Field(description="The checkpoint folder read (where the job's spec as run writes it).")
    output: str
    status: ExportStatus = Field(
        description="pending (recorded, or waiting on the launcher), running, succeeded or failed."
    )
    message: str | None = Field(description="Why it failed (the launcher's message, the command's error).")
    submission_id: str = Field(description="The launcher's (Ray's) submission id of the export.")
    created_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Export) -> ExportOut:
        return cls(
            id=row.id,
            job_id=row.job_id,
            iteration=row.iteration,
            format=row.format,
            dtype=row.dtype,
            checkpoint=row.source,
            output=row.output,
            status=row.status,
            message=row.message,
            submission_id=row.submission_id,
            created_at=stored_time(row.created_at),
            finished_at=stored_time(row.finished_at),
        )


class ExportList(BaseModel):
    exports: list[ExportOut]


# What a telemetry batch may hold. Every value a client writes is stored and served back on
# every later read (events, metrics, /metrics), so the bounds are those of the store and of
# the read path: a record that gets in must never make the job's record unreadable.
MAX_INT = 2**53  # exact in JSON and in a float; far beyond any count, byte size or id we send
ITERATION_MAX = 2**31 - 1  # the store's iteration columns
# Unix seconds of 1970-01-01 .. 2100-01-01: every platform's datetime can represent them.
TS_MIN, TS_MAX = 0.0, 4_102_444_800.0
MAX_STRING = 65536  # a watchdog message carries every thread's stack
MAX_KEY = 128
MAX_ITEMS = 512  # per list and per mapping
MAX_DEPTH = 6  # a record's `timers` is two levels deep; events are flat

Iteration = Annotated[int, Field(ge=0, le=ITERATION_MAX, strict=True)]
Counter = Annotated[int, Field(ge=0, le=MAX_INT, strict=True)]
Timestamp = Annotated[
    float, Field(ge=TS_MIN, le=TS_MAX, description="Unix seconds, between 1970 and 2100.")
]
Text = Annotated[str, Field(max_length=MAX_STRING)]


def _check_free_value(value: Any, where: str, depth: int = 0) -> None:
    """Values of fields the schema does not name: JSON scalars, lists and mappings within bounds.
    Non-finite floats are allowed (a diverged loss is a real observation) and stored as null."""
    if value is None or isinstance(value, bool | float):
        return
    if isinstance(value, int):
        if not -MAX_INT <= value <= MAX_INT:
            raise ValueError(f"{where}: integer {value} is outside +-2**53: send a float for such sizes")
        return
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ValueError(f"{where}: text of {len(value)} characters, at most {MAX_STRING}")
        return
    if depth >= MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        if len(value) > MAX_ITEMS:
            raise ValueError(f"{where}: {len(value)} items, at most {MAX_ITEMS}")
        for i, item in enumerate(value):
            _check_free_value(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        if len(value) > MAX_ITEMS:
            raise ValueError(f"{where}: {len(value)} keys, at most {MAX_ITEMS}")
        for key, item in value.items():
            if len(key) > MAX_KEY:
                raise ValueError(f"{where}: a key of {len(key)} characters, at most {MAX_KEY}")
            _check_free_value(item, f"{where}.{key}", depth + 1)
        return
    raise ValueError(f"{where}: {type(value).__name__} is not a JSON value")


class _TelemetryItem(BaseModel):
    """Named fields are typed and bounded; the others are kept as sent, within the same bounds."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _bounded_extras(self) -> _TelemetryItem:
        extra = self.model_extra or {}
        if len(extra) > MAX_ITEMS:
            raise ValueError(f"{len(extra)} fields, at most {MAX_ITEMS}")
        for key, value in extra.items():
            if len(key) > MAX_KEY:
                raise ValueError(f"a field name of {len(key)} characters, at most {MAX_KEY}")
            _check_free_value(value, key)
        return self


class TelemetryRecord(_TelemetryItem):
    """One engine metrics record; fields beyond these are kept as sent."""

    iteration: Iteration
    loss: float | None = None
    tokens: Counter | None = None
    step_time_s: float | None = Field(None, ge=0)
    skipped: bool | None = None
    group: Iteration | None = Field(None, description="The worker group's number within the job.")
    attempt: Iteration | None = None
    ts: Timestamp | None = None


class TelemetryEvent(_TelemetryItem):
    """One event line: the engine's (rerun diagnoses, checkpoint_saved) or the workers' (restart)."""

    kind: str = Field(min_length=1, max_length=64)
    iteration: Iteration | None = None
    ts: Timestamp | None = None
    id: Annotated[str, Field(max_length=256)] | Counter | None = Field(
        None, description="Deduplication key; default: a hash of the event."
    )
    seconds: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)
    bytes: Counter | None = None
    uri: Text | None = None
    cause: Text | None = None
    diagnosis: Text | None = None
    message: Text | None = None


class TelemetryIn(BaseModel):
    records: list[TelemetryRecord] = Field(default_factory=list, max_length=5000)
    events: list[TelemetryEvent] = Field(default_factory=list, max_length=5000)


class TelemetryAck(BaseModel):
    records_accepted: int
    records_replaced: int
    records_ignored: int = Field(description="Iterations already stored (a redelivery).")
    events_accepted: int
    events_duplicate: int
    state: JobState
    stop: Literal["checkpoint"] | None = Field(
        None,
        description="'checkpoint': the scheduler preempts this job: save a checkpoint of the current "
        "step and stop (the workers' RankHooks.should_stop).",
    )
    replicas: int | None = Field(
        None,
        description="resilience.resize: live: the replica groups the scheduler is resizing this job to (its "
        "driver releases or adds groups at a step boundary and reports `resized`); None: no resize asked.",
    )
