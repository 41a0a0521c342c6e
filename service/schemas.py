"""Request and response bodies of the REST API (the job specification itself is engine/jobspec.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.states import JobState
from service.store.models import Checkpoint, Job, JobEvent


def _time(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


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
            time=_time(row.ts),
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
            time=_time(latest.get("ts")),
        )


class JobSummary(BaseModel):
    id: str
    name: str
    tenant: str
    state: JobState
    created_at: datetime
    updated_at: datetime
    iteration: int | None = Field(description="The last iteration reported by the workers.")
    train_iters: int
    restarts: int

    @classmethod
    def from_row(cls, job: Job) -> JobSummary:
        return cls(**_summary_fields(job))


def _summary_fields(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "name": job.name,
        "tenant": job.tenant,
        "state": JobState(job.state),
        "created_at": _time(job.created_at),
        "updated_at": _time(job.updated_at),
        "iteration": job.current_iteration,
        "train_iters": job.train_iters,
        "restarts": job.restarts,
    }


class JobOut(JobSummary):
    spec: dict[str, Any] = Field(description="The job specification as it runs (defaults filled in).")
    started_at: datetime | None
    finished_at: datetime | None
    last_metrics: dict[str, Any] | None = Field(description="The newest metrics record.")
    last_progress_at: datetime | None
    latest_checkpoint: CheckpointOut | None
    failure_cause: str | None
    cancel_requested_at: datetime | None
    submission_id: str | None = Field(description="The Ray job's submission id of the current attempt.")
    attempt: int

    @classmethod
    def from_row(cls, job: Job) -> JobOut:
        return cls(
            **_summary_fields(job),
            spec=job.spec,
            started_at=_time(job.started_at),
            finished_at=_time(job.finished_at),
            last_metrics=job.last_record,
            last_progress_at=_time(job.last_progress_at),
            latest_checkpoint=CheckpointOut.from_latest(job.latest_checkpoint),
            failure_cause=job.failure_cause,
            cancel_requested_at=_time(job.cancel_requested_at),
            submission_id=job.submission_id,
            attempt=job.attempt,
        )


class JobList(BaseModel):
    jobs: list[JobSummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class EventOut(BaseModel):
    id: int
    time: datetime
    kind: str = Field(description="state, launch, reconciled, restart, diagnosis, checkpoint_saved, ...")
    iteration: int | None
    message: str | None
    data: dict[str, Any]

    @classmethod
    def from_row(cls, row: JobEvent) -> EventOut:
        return cls(
            id=row.id,
            time=_time(row.ts),
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


class TelemetryRecord(BaseModel):
    """One engine metrics record; fields beyond these are kept as sent."""

    model_config = ConfigDict(extra="allow")
    iteration: int = Field(ge=0, le=2**31 - 1)
    loss: float | None = None
    tokens: int | None = Field(None, ge=0)
    step_time_s: float | None = Field(None, ge=0)
    skipped: bool | None = None


class TelemetryEvent(BaseModel):
    """One event line: the engine's (rerun diagnoses, checkpoint_saved) or the workers' (restart)."""

    model_config = ConfigDict(extra="allow")
    kind: str = Field(min_length=1, max_length=64)
    iteration: int | None = Field(None, ge=0, le=2**31 - 1)
    ts: float | None = None


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
