"""The REST bodies of evaluations (POST /v1/jobs/{id}/checkpoints/{iteration}/evals): what may
be asked (shipped tasks only, bounded work) and what is answered."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.jobspec.evaluation import SHIPPED_TASKS
from service.schemas import stored_time
from service.store.models import Evaluation

MAX_EVAL_RANKS = 64


class EvalIn(BaseModel):
    """lm-eval tasks to run on a committed checkpoint, and the layout to run them on."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(
        min_length=1,
        max_length=len(SHIPPED_TASKS),
        description=f"lm-eval tasks shipped with elastron: {', '.join(SHIPPED_TASKS)} (their data ship with it; "
        "`elastron eval` on the command line runs any task over local files).",
    )
    limit: int | None = Field(None, ge=1, le=100_000, description="At most this many documents per task.")
    num_fewshot: int | None = Field(None, ge=0, le=32, description="Few-shot examples per prompt (default: the task's).")
    ranks: int = Field(1, ge=1, le=MAX_EVAL_RANKS, description="Processes (GPUs) of the evaluation.")
    tensor: int = Field(1, ge=1, le=MAX_EVAL_RANKS, description="Tensor-parallel size.")
    pipeline: int = Field(1, ge=1, le=MAX_EVAL_RANKS, description="Pipeline-parallel size.")

    @field_validator("tasks")
    @classmethod
    def _shipped(cls, tasks: list[str]) -> list[str]:
        unknown = [t for t in tasks if t not in SHIPPED_TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {', '.join(map(repr, unknown))}: choose from {', '.join(SHIPPED_TASKS)}")
        if len(set(tasks)) != len(tasks):
            raise ValueError("a task is named twice")
        return tasks

    @model_validator(mode="after")
    def _layout(self) -> EvalIn:
        if self.ranks % (self.tensor * self.pipeline):
            raise ValueError(f"ranks {self.ranks} is not a multiple of tensor x pipeline = {self.tensor * self.pipeline}")
        return self

    def options(self) -> dict[str, Any]:
        return self.model_dump(exclude={"tasks"})


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
