"""What a user submits to run a sweep: a base job, the fields to vary, the metric, the budget, how
trials are drawn (Optuna's sampler) and how losers are stopped early (Optuna's pruner).

A trial's progress is counted in training iterations: the pruner's resources (`min_resource`,
`max_resource`) are iterations, and a trial reports its metric at every record that carries it
(`loss`: each `training.log_interval`; `valid_loss`: each `training.eval_interval`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.jobspec import JobSpec
from service.sweeps.space import SearchSpace, grid, space_problems

MAX_TRIALS = 1000
MAX_PARALLEL = 64


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class MetricSpec(_Part):
    name: Literal["loss", "valid_loss"] = Field(
        "valid_loss", description="valid_loss needs training.eval_interval in the base job."
    )
    direction: Literal["min", "max"] = "min"


class BudgetSpec(_Part):
    max_trials: int = Field(ge=1, le=MAX_TRIALS, description="Trials the sweep starts at most.")
    max_parallel: int = Field(2, ge=1, le=MAX_PARALLEL, description="Trials running at once at most.")
    gpu_hours: float | None = Field(
        None, gt=0, description="Stop starting trials once the trials have used this many GPU-hours."
    )


class SamplerSpec(_Part):
    name: Literal["random", "grid", "tpe"] = "tpe"
    seed: int | None = Field(None, ge=0, description="Fixes the draws: the same sweep draws the same trials.")


class PrunerSpec(_Part):
    name: Literal["none", "asha", "hyperband"] = "asha"
    min_resource: int = Field(1, ge=1, description="Iterations a trial runs before it can be stopped.")
    reduction_factor: int = Field(3, ge=2, description="1 in reduction_factor trials goes on at each rung.")
    max_resource: int | None = Field(
        None, ge=1, description="hyperband: a trial's most iterations (default: the base job's train_iters)."
    )
    min_early_stopping_rate: int = Field(0, ge=0, description="asha: skips the first rungs.")


class SweepSpec(_Part):
    name: str = Field("sweep", pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")
    base: dict[str, Any] = Field(
        description="The job spec every trial starts from (as POST /v1/jobs takes it)."
    )
    search_space: SearchSpace = Field(description="Job-spec field path -> a float or int range or a choice.")
    metric: MetricSpec = Field(default_factory=MetricSpec)
    budget: BudgetSpec
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)


def sweep_problems(spec: SweepSpec, base: JobSpec) -> list[tuple[str, str]]:
    """(field, message) for what makes this sweep unable to run, given its base job already
    validated (`base`: the service checks `spec.base` as it checks a job submission, storage
    confinement first): fields and values the job spec refuses, a metric the base job never
    reports, a grid that is not one, a pruner's resources past the trial's length."""
    # Probed in the accepted base: it carries model.init_from's config already (and its digest),
    # so no probe reads that config.json again (up to 16 x 64 reads, S3 too, on the request path).
    problems = space_problems(base.model_dump(mode="json"), spec.search_space)
    space_ok = not problems
    if spec.metric.name == "valid_loss" and base.training.eval_interval is None:
        problems.append(
            (
                "metric.name",
                "metric.name: valid_loss needs base.training.eval_interval (the trials evaluate at it); "
                "set it, or use metric name loss",
            )
        )
    if spec.sampler.name == "grid" and space_ok:
        try:
            grid(spec.search_space, limit=MAX_TRIALS)
        except ValueError as err:
            problems.append(("sampler.name", f"sampler.name: grid: {err}"))
    iters = base.training.train_iters
    p = spec.pruner
    if p.name != "none" and p.min_resource >= iters:
        problems.append(
            (
                "pruner.min_resource",
                f"pruner.min_resource ({p.min_resource}) must be below base.training.train_iters ({iters}): "
                "a trial would end before it could be stopped",
            )
        )
    if p.max_resource is not None and p.max_resource > iters:
        problems.append(
            (
                "pruner.max_resource",
                f"pruner.max_resource ({p.max_resource}) is past base.training.train_iters ({iters})",
            )
        )
    return problems
