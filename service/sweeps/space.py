"""A sweep's search space: which fields of the job spec a sweep varies, the values each may take,
and the trial's job spec made from one draw.

A parameter is named by its path in the job spec (`optimizer.lr`, `training.global_batch_size`,
`model.lora.rank`) and is a float range, an int range (either on a log scale) or a list of
choices. Before a sweep starts, `space_problems` checks every path against the job spec's schema
and every bound and choice against the job spec's own rules, each value in the base job with the
other fields as they are, so a sweep that could only ever make refused trials is refused with the
field and the value named. What it cannot see (two varied fields refused only together) reaches a
trial as a job spec that fails validation: that trial is recorded as failed, not the sweep.

Optuna draws the values (`suggest`: its trial API, whatever sampler the study runs); this module
only says what to draw and where it goes.
"""

from __future__ import annotations

import copy
import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from engine.jobspec import JobSpec, JobSpecError, parse_job

MAX_CHOICES = 64  # a choice list is data in the request: bounded
MAX_PARAMETERS = 16


class _Param(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FloatRange(_Param):
    type: Literal["float"]
    low: float
    high: float
    log: bool = Field(False, description="Draw on a log scale (both bounds > 0), e.g. a learning rate.")
    step: float | None = Field(None, gt=0, description="Only multiples of step above low (no log scale).")


class IntRange(_Param):
    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int = Field(1, ge=1)


class Choice(_Param):
    type: Literal["choice"]
    values: list[bool | int | float | str] = Field(min_length=1, max_length=MAX_CHOICES)


Parameter = Annotated[FloatRange | IntRange | Choice, Field(discriminator="type")]
SearchSpace = dict[str, Parameter]


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model an annotation holds (`LoRASpec | None` -> LoRASpec), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _section_model(arg)
            if found is not None:
                return found
    return None


def field_problem(path: str) -> str | None:
    """Why `path` names no settable field of a job spec, or None when it does."""
    model: type[BaseModel] = JobSpec
    parts = path.split(".")
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        where = ".".join(parts[:depth]) or "the job spec"
        if field is None:
            return f"{where} has no field {part!r}: known fields there: {', '.join(model.model_fields)}"
        inner = _section_model(field.annotation)
        last = depth == len(parts) - 1
        if last and inner is not None:
            return (
                f"{path} is a section, not a field: name one of its fields ({', '.join(inner.model_fields)})"
            )
        if not last:
            if inner is None:
                return f"{'.'.join(parts[: depth + 1])} is a field, not a section: it has no {parts[depth + 1]!r}"
            model = inner
    return None


def with_values(base: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of the job spec dict `base` with each path in `values` set (sections made as needed:
    varying `model.lora.rank` in a base job without LoRA gives it LoRA's defaults and that rank)."""
    out = copy.deepcopy(base)
    for path, value in values.items():
        *sections, name = path.split(".")
        node = out
        for section in sections:
            child = node.get(section)
            if not isinstance(child, dict):
                child = node[section] = {}
            node = child
        node[name] = value
    return out


def _range_problems(key: str, p: FloatRange | IntRange) -> list[tuple[str, str]]:
    if p.low > p.high:
        return [(f"{key}.low", f"{key}: low ({p.low}) is above high ({p.high})")]
    if p.log and p.low <= 0:
        return [
            (
                f"{key}.low",
                f"{key}: a log scale needs low > 0 (got {p.low}): set log: false or a positive low",
            )
        ]
    if p.log and isinstance(p, FloatRange) and p.step is not None:
        return [(f"{key}.step", f"{key}: step and log cannot both be set (Optuna draws one or the other)")]
    if p.log and isinstance(p, IntRange) and p.step != 1:
        return [(f"{key}.step", f"{key}: an int on a log scale takes step 1 only")]
    return []


def probe_values(p: FloatRange | IntRange | Choice) -> list[tuple[str, Any]]:
    """The values a search-space check tries in the base job: both bounds, or every choice."""
    if isinstance(p, Choice):
        return [(f"values[{i}]", v) for i, v in enumerate(p.values)]
    return [("low", p.low), ("high", p.high)]


def space_problems(
    base: dict[str, Any], space: SearchSpace, where: str = "search_space"
) -> list[tuple[str, str]]:
    """(field, message) for every path the job spec lacks and every bound or choice its rules
    refuse in `base`; empty when the space can be swept. `base` must itself be a valid job."""
    if not space:
        return [(where, f"{where}: name at least one job-spec field to vary, e.g. optimizer.lr")]
    if len(space) > MAX_PARAMETERS:
        return [(where, f"{where}: at most {MAX_PARAMETERS} parameters (got {len(space)})")]
    problems: list[tuple[str, str]] = []
    for path, param in space.items():
        key = f"{where}.{path}"
        missing = field_problem(path)
        if missing:
            problems.append((key, f"{key}: {missing}"))
            continue
        if not isinstance(param, Choice):
            bad_range = _range_problems(key, param)
            if bad_range:
                problems.extend(bad_range)
                continue
        for name, value in probe_values(param):
            try:
                parse_job(with_values(base, {path: value}))
            except JobSpecError as err:
                reason = "; ".join(str(err).splitlines())
                problems.append(
                    (
                        f"{key}.{name}",
                        f"{key}.{name}: {path} = {value!r} is refused by the job spec: {reason}",
                    )
                )
    return problems


def suggest(trial: Any, space: SearchSpace) -> dict[str, Any]:
    """One draw of every parameter through an Optuna trial (`optuna.Trial` or the one `ask()`
    returns), in the space's order; the parameter names are the job-spec paths."""
    values: dict[str, Any] = {}
    for path, p in space.items():
        if isinstance(p, FloatRange):
            values[path] = trial.suggest_float(path, p.low, p.high, log=p.log, step=p.step)
        elif isinstance(p, IntRange):
            values[path] = trial.suggest_int(path, p.low, p.high, log=p.log, step=p.step)
        else:
            values[path] = trial.suggest_categorical(path, p.values)
    return values


def grid(space: SearchSpace, limit: int) -> dict[str, list[Any]]:
    """Every value of every parameter, for a grid search: choices, int ranges and float ranges
    with a step. Raises ValueError naming the parameter that has no finite grid or the total
    over `limit` (a grid is every combination: it is the sweep's trial count)."""
    out: dict[str, list[Any]] = {}
    total = 1
    for path, p in space.items():
        if isinstance(p, Choice):
            values = list(p.values)
        elif isinstance(p, IntRange):
            if p.log:
                raise ValueError(f"{path}: a grid takes no log-scale range: list the values as a choice")
            values = list(range(p.low, p.high + 1, p.step))
        elif p.step is None or p.log:
            raise ValueError(
                f"{path}: a float range needs a step (and no log scale) to be a grid, or list the values"
            )
        else:
            count = int((p.high - p.low) / p.step + 1e-9) + 1
            values = [round(p.low + i * p.step, 12) for i in range(count)]
        total *= len(values)
        if total > limit:
            raise ValueError(
                f"the grid has over {limit} combinations (at {path}): narrow it or use sampler random or tpe"
            )
        out[path] = values
    return out
