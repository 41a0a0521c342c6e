"""`evaluation`: lm-eval tasks run on the job's checkpoints, and what the service may ask for.

`evaluation.on_checkpoint` asks the service to evaluate every N-th committed checkpoint of the
job as it is saved (service/store/evals.py): the same request as
POST /v1/jobs/{id}/checkpoints/{iteration}/evals, recorded in the transaction that records the
checkpoint, so each checkpoint gets its evaluation once. `EvalRequestSpec` is that request's
body, shared by both.

Over REST (and so in `on_checkpoint`) a tenant names tasks only from SHIPPED_TASKS: their data
ship in the package (engine/harness/tasks/, local JSON lines), so an evaluation reads no hub and
no tenant's files, and a task YAML from storage, whose `!function` would run code, is never
loaded. `elastron eval` on the command line takes any task over local files
(engine/harness/tasks.py). tests/engine/test_harness.py keeps this list equal to the shipped YAMLs.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator, model_validator

from engine.jobspec.common import PositiveInt, _Section

SHIPPED_TASKS = ("elastron_gen", "elastron_mc", "elastron_ppl")
MAX_EVAL_RANKS = 64
NOT_SCORES = ("sample_len",)  # lm-eval puts these beside the metrics; they count, not score


def metric_scores(results: Any) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of lm-eval's `results`: its "metric,filter" keys cut to the
    metric, standard errors, counts and non-numbers left out. The one reading of lm-eval's
    scores: the CLI prints it, the loggers get it, the service parses it from a log (so it
    takes untrusted JSON: names capped at 128 characters, non-finite values dropped)."""
    scores: dict[str, dict[str, float]] = {}
    if not isinstance(results, dict):
        return scores
    for task, metrics in results.items():
        if not isinstance(metrics, dict):
            continue
        for key, value in metrics.items():
            name = str(key).split(",")[0]
            if "_stderr" in name or name in NOT_SCORES or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                scores.setdefault(str(task)[:128], {})[name[:128]] = float(value)
    return scores


class EvalRequestSpec(_Section):
    """lm-eval tasks to run on a committed checkpoint, and the layout to run them on."""

    tasks: list[str] = Field(
        min_length=1,
        max_length=len(SHIPPED_TASKS),
        description=f"lm-eval tasks shipped with elastron: {', '.join(SHIPPED_TASKS)} (their data ship with it; "
        "`elastron eval` on the command line runs any task over local files).",
    )
    limit: int | None = Field(None, ge=1, le=100_000, description="At most this many documents per task.")
    num_fewshot: int | None = Field(None, ge=0, le=32, description="Few-shot examples per prompt (default: the task's).")
    ranks: int = Field(1, ge=1, le=MAX_EVAL_RANKS, description="Processes (GPUs) of the evaluation.")
    tensor: int = Field(1, ge=1, le=MAX_EVAL_RANKS, description="Tensor-parallel size of the evaluation.")
    pipeline: int = Field(1, ge=1, le=MAX_EVAL_RANKS, description="Pipeline-parallel size of the evaluation.")

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
    def _layout(self):
        if self.ranks % (self.tensor * self.pipeline):
            raise ValueError(f"ranks {self.ranks} is not a multiple of tensor x pipeline = {self.tensor * self.pipeline}")
        return self

    def options(self) -> dict:
        """What a recorded evaluation keeps beside its tasks (the same keys for every request)."""
        return {k: getattr(self, k) for k in ("limit", "num_fewshot", "ranks", "tensor", "pipeline")}


class OnCheckpointSpec(EvalRequestSpec):
    every: PositiveInt = Field(1, description="Evaluate every N-th committed checkpoint (1: each one).")


class EvaluationSpec(_Section):
    on_checkpoint: OnCheckpointSpec | None = Field(
        None,
        description="Evaluate the job's checkpoints as they are committed (service: one `elastron eval` Ray job "
        "per checkpoint, its scores in GET /v1/jobs/{id}/evals).",
    )
