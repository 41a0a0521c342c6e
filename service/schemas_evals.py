"""The REST bodies of evaluations (POST /v1/jobs/{id}/checkpoints/{iteration}/evals): what may
be asked (shipped tasks only, bounded work) and what is answered."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from engine.jobspec.evaluation import EvalRequestSpec
from service.schemas import stored_time
from service.store.models import Evaluation


class EvalIn(EvalRequestSpec):
    """lm-eval tasks to run on a committed checkpoint, and the layout to run them on (the job
    spec's evaluation.on_checkpoint asks the same for each checkpoint)."""


EvalStatus = Literal["pending", "running", "succeeded", "failed"]


class EvalOut(BaseModel):
    id: str
    job_id: str
    iteration: int
    checkpoint: str = Field(description="The checkpoint folder read (where the job's spec as run writes it).")
    tasks: list[str]
    options: dict[str, Any] = Field(description="limit, num_fewshot, ranks, tensor, pipeline as asked.")
    status: EvalStatus = Field(description="pending (recorded, or waiting on the launcher), running, succeeded or failed.")
    results: dict[str, dict[str, float]] | None = Field(
        description="lm-eval's metrics per task (e.g. {\"elastron_mc\": {\"acc\": 0.5}}), once succeeded."
    )
    message: str | None = Field(description="Why it failed (the launcher's message, the command's error).")
    submission_id: str = Field(description="The launcher's (Ray's) submission id of the evaluation.")
    created_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Evaluation) -> EvalOut:
        return cls(
            id=row.id,
            job_id=row.job_id,
            iteration=row.iteration,
            checkpoint=row.source,
            tasks=row.tasks,
            options=row.options,
            status=row.status,
            results=row.results,
            message=row.message,
            submission_id=row.submission_id,
            created_at=stored_time(row.created_at),
            finished_at=stored_time(row.finished_at),
        )


class EvalList(BaseModel):
    evals: list[EvalOut]
