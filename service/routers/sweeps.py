"""/v1/sweeps: submit, list, inspect and cancel hyperparameter sweeps.

Submitting checks the sweep whole before anything runs: its base job as a job submission is
checked (storage confinement first, then the job spec's rules and the tenant's admission), every
search-space path and value against the job spec, the metric, the pruner and the grid; each
problem is a 422 entry naming its field (`base.training.global_batch_size`,
`search_space.optimizer.lr.high`). Then the sweep is recorded and the reconciler draws its trials
(service/reconcile/sweeps.py); no route here waits on Ray or on a trial.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Path, Response, status
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.deps import Caller, Ctx, DbSession
from service.scheduling.admission import check_submission
from service.schemas import Problem
from service.storage_policy import roots_for
from service.store.db import in_transaction
from service.store.models import Sweep
from service.store.sweeps import SWEEP_FINAL, create_sweep, get_sweep, metric_points, new_sweep_id, trials_of
from service.submission import SpecProblem, accept_spec
from service.sweeps.bodies import HISTORY_POINTS, SweepList, SweepOut, SweepSummary, TrialOut
from service.sweeps.spec import MAX_TRIALS, SweepSpec, sweep_problems

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"])

AUTH = {401: {"model": Problem, "description": "Missing, invalid or revoked token."}}
NOT_FOUND = {404: {"model": Problem, "description": "No such sweep among the caller's tenant's sweeps."}}
SweepId = Annotated[
    str, Path(min_length=1, max_length=96, description="The sweep id returned at submission.")
]


def _not_found(sweep_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no sweep {sweep_id!r}")


def _visible(session: Session, caller, sweep_id: str) -> Sweep:
    sweep = get_sweep(session, sweep_id)
    if sweep is None or not caller.can_see(sweep.tenant):
        raise _not_found(sweep_id)
    return sweep


def _out(session: Session, sweep: Sweep) -> SweepOut:
    metric = (sweep.spec.get("metric") or {}).get("name", "valid_loss")
    trials = [
        TrialOut.from_row(
            t, metric_points(session, t.job_id, metric, limit=HISTORY_POINTS, newest=True) if t.job_id else []
        )
        for t in trials_of(session, sweep.id)
    ]
    return SweepOut(**SweepSummary.fields_of(sweep), spec=sweep.spec, trials=trials)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=SweepOut,
    responses={
        **AUTH,
        403: {"model": Problem, "description": "The base job asks for what the tenant may not use."},
        422: {
            "model": Problem,
            "description": "The sweep cannot run: one entry per problem, naming the field.",
        },
        429: {
            "model": Problem,
            "description": "Too many submissions, or the tenant's queued-jobs quota is full.",
        },
    },
)
def submit_sweep(
    body: Annotated[SweepSpec, Body()], ctx: Ctx, caller: Caller, response: Response
) -> SweepOut:
    """Record a sweep; its trials are drawn and queued as jobs by the reconciler."""
    with ctx.sessions() as session:
        roots = roots_for(ctx.settings, session, caller)
    try:
        base = accept_spec(body.base, roots)
    except SpecProblem as err:
        raise SpecProblem([(f"base.{f}" if f else "base", m) for f, m in err.problems]) from None
    problems = sweep_problems(body, base)
    if problems:
        raise SpecProblem(problems)
    ctx.limits.enforce(caller.tenant, "submit", "submits")
    if body.pruner.max_resource is None:  # recorded: a trial's length, what Hyperband's top rung is
        body = body.model_copy(
            update={"pruner": body.pruner.model_copy(update={"max_resource": base.training.train_iters})}
        )

    def create(session: Session) -> SweepOut:
        check_submission(session, caller, base, ctx.reconciler.capacity, ctx.settings)
        sweep = create_sweep(
            session,
            sweep_id=new_sweep_id(body.name),
            tenant=caller.tenant,
            admin=caller.admin,
            spec=body.model_dump(mode="json"),
        )
        return _out(session, sweep)

    out = in_transaction(ctx.sessions, create)
    ctx.reconciler.nudge()
    response.headers["Location"] = f"/v1/sweeps/{out.id}"
    return out


@router.get("", response_model=SweepList, responses={**AUTH})
def list_sweeps(session: DbSession, caller: Caller) -> SweepList:
    """The caller's tenant's sweeps (every tenant's for an admin), newest first."""
    query = select(Sweep).order_by(Sweep.created_at.desc()).limit(500)
    if not caller.admin:
        query = query.where(Sweep.tenant == caller.tenant)
    return SweepList(sweeps=[SweepSummary.from_row(s) for s in session.scalars(query)])


@router.get("/{sweep_id}", response_model=SweepOut, responses={**AUTH, **NOT_FOUND})
def get_sweep_details(sweep_id: SweepId, session: DbSession, caller: Caller) -> SweepOut:
    """The sweep, its trials (values, state, metric history) and its best trial."""
    return _out(session, _visible(session, caller, sweep_id))


@router.post(
    "/{sweep_id}/cancel",
    response_model=SweepOut,
    status_code=status.HTTP_202_ACCEPTED,
    responses={**AUTH, **NOT_FOUND, 409: {"model": Problem, "description": "The sweep already ended."}},
)
def cancel_sweep(sweep_id: SweepId, ctx: Ctx, caller: Caller) -> SweepOut:
    """Stop drawing trials and cancel the running ones; the sweep is `cancelled` once they end."""

    def cancel(session: Session) -> SweepOut:
        sweep = _visible(session, caller, sweep_id)
        if sweep.state in SWEEP_FINAL:
            raise HTTPException(status.HTTP_409_CONFLICT, detail=f"sweep {sweep_id} already {sweep.state}")
        if sweep.cancel_requested_at is None:
            sweep.cancel_requested_at = sweep.updated_at = time.time()
        return _out(session, sweep)

    out = in_transaction(ctx.sessions, cancel)
    ctx.reconciler.nudge()
    return out


class SweepExtension(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_trials: int = Field(
        ge=1, le=MAX_TRIALS, description="The sweep's new trial budget (above its trials so far)."
    )
    resume_pruned: bool = Field(
        False,
        description="Spend the new trials first on the pruned ones, best first: each a trial with the same values "
        "that continues the pruned trial's job from the checkpoint it saved when it stopped.",
    )


@router.post(
    "/{sweep_id}/extend",
    response_model=SweepOut,
    responses={
        **AUTH,
        **NOT_FOUND,
        409: {"model": Problem, "description": "The sweep was cancelled."},
        422: {"model": Problem, "description": "max_trials is not above the trials the sweep has run."},
    },
)
def extend_sweep(
    sweep_id: SweepId, body: Annotated[SweepExtension, Body()], ctx: Ctx, caller: Caller
) -> SweepOut:
    """Raise a running or completed sweep's trial budget; with `resume_pruned`, its pruned trials
    continue from their checkpoints (best first) before new values are drawn."""

    def extend(session: Session) -> SweepOut:
        sweep = _visible(session, caller, sweep_id)
        if sweep.cancel_requested_at is not None or sweep.state == "cancelled":
            raise HTTPException(
                status.HTTP_409_CONFLICT, detail=f"sweep {sweep_id} was cancelled: submit a new one"
            )
        trials = trials_of(session, sweep_id)
        if body.max_trials <= len(trials):
            raise SpecProblem(
                [
                    (
                        "max_trials",
                        f"max_trials ({body.max_trials}) must be above the {len(trials)} trials sweep {sweep_id} has",
                    )
                ]
            )
        spec = dict(sweep.spec)
        spec["budget"] = {**spec["budget"], "max_trials": body.max_trials}
        if body.resume_pruned:
            sign = -1 if (spec.get("metric") or {}).get("direction") == "max" else 1
            pruned = sorted(
                (t for t in trials if t.state == "pruned" and t.job_id and t.value is not None),
                key=lambda t: sign * t.value,
            )
            room = body.max_trials - len(trials)
            sweep.pending_resumes = [*(sweep.pending_resumes or []), *(t.job_id for t in pruned[:room])]
        sweep.spec = spec
        sweep.state, sweep.finished_at, sweep.updated_at = "running", None, time.time()
        sweep.message = f"extended to {body.max_trials} trials"
        return _out(session, sweep)

    out = in_transaction(ctx.sessions, extend)
    ctx.reconciler.nudge()
    return out
