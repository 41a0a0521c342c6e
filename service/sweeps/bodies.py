"""Response bodies of /v1/sweeps (the request body is service/sweeps/spec.SweepSpec)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from service.schemas import stored_time
from service.store.models import Sweep, SweepTrial

HISTORY_POINTS = 200  # per trial in a sweep's page: the newest ones


class TrialOut(BaseModel):
    number: int = Field(description="The trial's number in the sweep's Optuna study.")
    job_id: str | None = Field(description="Its job; null when its drawn job spec was refused (see message).")
    state: str = Field(description="waiting | running | pruning | complete | pruned | failed")
    params: dict[str, Any] = Field(description="Job-spec field path -> the value this trial runs with.")
    resumes_job: str | None = Field(
        None,
        description="The pruned trial's job it continues from its checkpoint (an extension's resume_pruned).",
    )
    value: float | None = Field(description="Its newest value of the sweep's metric.")
    iteration: int = Field(description="The iteration of that value.")
    history: list[tuple[int, float]] = Field(
        default_factory=list, description=f"(iteration, metric) pairs, the newest {HISTORY_POINTS}."
    )
    message: str | None
    created_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: SweepTrial, history: list[tuple[int, float]]) -> TrialOut:
        return cls(
            number=row.number,
            job_id=row.job_id,
            state=row.state,
            params=row.params or {},
            resumes_job=row.resumes_job,
            value=row.value,
            iteration=row.reported_iteration or 0,
            history=history,
            message=row.message,
            created_at=stored_time(row.created_at),
            finished_at=stored_time(row.finished_at),
        )


class SweepSummary(BaseModel):
    id: str
    name: str
    tenant: str
    state: str = Field(description="running | completed | cancelled")
    metric: dict[str, Any] = Field(description="The metric and its direction.")
    trials_started: int
    gpu_hours: float = Field(
        description="Rank-hours the ended trials used (a rank is a GPU; one CPU process on CPU)."
    )
    best: dict[str, Any] | None = Field(
        description="The best complete trial as the study ranks it: number, value, params, job_id."
    )
    message: str | None
    created_at: datetime | None
    finished_at: datetime | None
    cancel_requested_at: datetime | None

    @classmethod
    def fields_of(cls, sweep: Sweep) -> dict[str, Any]:
        return {
            "id": sweep.id,
            "name": sweep.name,
            "tenant": sweep.tenant,
            "state": sweep.state,
            "metric": (sweep.spec or {}).get("metric", {}),
            "trials_started": sweep.trials_started or 0,
            "gpu_hours": round((sweep.gpu_seconds or 0.0) / 3600, 6),
            "best": sweep.best,
            "message": sweep.message,
            "created_at": stored_time(sweep.created_at),
            "finished_at": stored_time(sweep.finished_at),
            "cancel_requested_at": stored_time(sweep.cancel_requested_at),
        }

    @classmethod
    def from_row(cls, sweep: Sweep) -> SweepSummary:
        return cls(**cls.fields_of(sweep))


class SweepOut(SweepSummary):
    spec: dict[str, Any] = Field(description="The sweep as submitted (defaults filled in).")
    trials: list[TrialOut]


class SweepList(BaseModel):
    sweeps: list[SweepSummary]
