"""A sweep's Optuna study: the sampler and pruner it runs, where it is stored, and the few calls
the service makes of it (ask for a trial, report a trial's metric at an iteration, tell how it
ended, read the best).

Optuna does the search (TPE, random, grid) and the early stopping (successive halving = ASHA,
Hyperband) through its ask-and-tell interface; nothing here ranks trials. The study lives in the
store's database, so a sweep outlives an API restart with its trials and their reports intact:
- Postgres: the same database, in a schema of its own (STUDY_SCHEMA);
- SQLite: a file beside the store's (`elastron.db` -> `elastron.optuna.db`).
Not the store's own tables: Optuna versions its tables with Alembic's default `alembic_version`
table, the one the store's migrations use (service/store/migrate.py), so the two cannot share a
namespace.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import optuna
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from service.sweeps.space import SearchSpace, grid, suggest
from service.sweeps.spec import MAX_TRIALS, SweepSpec

STUDY_SCHEMA = "elastron_optuna"
RESUMES = "elastron_resumes_job"  # a trial's user attribute: the pruned trial's job it continues
_DIRECTIONS = {"min": "minimize", "max": "maximize"}

optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per trial is the service's to log


def study_storage(database_url: str) -> optuna.storages.RDBStorage:
    """Optuna's storage for the store at `database_url` (see the module docstring)."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        if not url.database or url.database == ":memory:":
            raise ValueError(
                "sweeps need a store on disk or Postgres: an in-memory SQLite store cannot hold a study"
            )
        stem = url.database.removesuffix(".db")
        return optuna.storages.RDBStorage(url.set(database=f"{stem}.optuna.db").render_as_string(False))
    if url.get_backend_name() == "postgresql":
        engine = create_engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {STUDY_SCHEMA}"))
        finally:
            engine.dispose()
        return optuna.storages.RDBStorage(
            url.render_as_string(False),
            engine_kwargs={"connect_args": {"options": f"-c search_path={STUDY_SCHEMA}"}},
        )
    raise ValueError(f"no sweep storage for a {url.get_backend_name()} store: use SQLite or Postgres")


class AskTellGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler for ask-and-tell: its `after_trial` calls `study.stop()` once the
    grid is used up, which works only inside `study.optimize` and raises a RuntimeError at the
    service's last `tell`. The sweep ends a grid itself (its trial count is the grid's size), so
    that hook does nothing here."""

    def after_trial(self, study, trial, state, values) -> None:
        return None


def make_sampler(spec: SweepSpec) -> optuna.samplers.BaseSampler:
    s = spec.sampler
    if s.name == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    if s.name == "grid":
        return AskTellGridSampler(grid(spec.search_space, limit=MAX_TRIALS), seed=s.seed)
    return optuna.samplers.TPESampler(seed=s.seed)


def make_pruner(spec: SweepSpec, train_iters: int) -> optuna.pruners.BasePruner:
    """ASHA is Optuna's SuccessiveHalvingPruner (asynchronous: a trial is judged against the trials
    that reached its rung before it, so no trial waits for a rung to fill)."""
    p = spec.pruner
    if p.name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=p.min_resource,
            reduction_factor=p.reduction_factor,
            min_early_stopping_rate=p.min_early_stopping_rate,
        )
    if p.name == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=p.min_resource,
            max_resource=p.max_resource or train_iters,
            reduction_factor=p.reduction_factor,
        )
    return optuna.pruners.NopPruner()


@dataclass(frozen=True)
class Best:
    number: int
    value: float
    params: dict[str, Any]


class SweepStudy:
    """One sweep's study. Trials are named by their Optuna number (0, 1, ...), which the service
    keeps with the trial's job; every call goes to storage, so any API replica or a restarted one
    can continue a sweep another began."""

    def __init__(self, study: optuna.Study, space: SearchSpace, storage: optuna.storages.BaseStorage) -> None:
        self.study, self.space, self.storage = study, space, storage

    @classmethod
    def open(
        cls, spec: SweepSpec, sweep_id: str, storage: optuna.storages.BaseStorage, train_iters: int
    ) -> SweepStudy:
        """Create the sweep's study, or load it when it exists (an API restart)."""
        study = optuna.create_study(
            storage=storage,
            study_name=f"sweep-{sweep_id}",
            direction=_DIRECTIONS[spec.metric.direction],
            sampler=make_sampler(spec),
            pruner=make_pruner(spec, train_iters),
            load_if_exists=True,
        )
        return cls(study, spec.search_space, storage)

    def ask(self) -> tuple[int, dict[str, Any]]:
        """A new trial: its number and the job-spec values it runs with."""
        trial = self.study.ask()
        return trial.number, suggest(trial, self.space)

    def _trial_id(self, number: int) -> int:
        """Trial `number`'s id in storage (Optuna's public storage interface): the API that asked
        for it may have restarted since."""
        study_id = self.storage.get_study_id_from_name(self.study.study_name)
        return self.storage.get_trial_id_from_study_id_trial_number(study_id, number)

    def _running(self, number: int) -> optuna.Trial:
        return optuna.Trial(self.study, self._trial_id(number))

    def report(self, number: int, iteration: int, value: float) -> bool:
        """Record trial `number`'s metric at `iteration`; True when the pruner stops it there."""
        trial = self._running(number)
        with warnings.catch_warnings():
            # A step reported again (the store's transaction after a report was retried, or the
            # API stopped between the two): Optuna keeps the first value and warns; nothing to say.
            warnings.filterwarnings("ignore", message=".*is already reported", category=UserWarning)
            trial.report(value, iteration)
        return trial.should_prune()

    def complete(self, number: int, value: float) -> None:
        self.study.tell(number, value)

    def pruned(self, number: int) -> None:
        self.study.tell(number, state=optuna.trial.TrialState.PRUNED)

    def failed(self, number: int) -> None:
        self.study.tell(number, state=optuna.trial.TrialState.FAIL)

    def finish(self, number: int, outcome: str, value: float | None = None) -> None:
        """Tell how trial `number` ended (`complete` with its value, `pruned`, `failed`), once:
        a trial told already is left as it is (the store's transaction that follows a tell may be
        retried, and Optuna refuses a second tell)."""
        if self.storage.get_trial(self._trial_id(number)).state.is_finished():
            return
        if outcome == "complete":
            self.complete(number, float(value))
        elif outcome == "pruned":
            self.pruned(number)
        else:
            self.failed(number)

    def enqueue_resume(self, params: dict[str, Any], job_id: str) -> bool:
        """Queue a trial with a pruned trial's values that continues its job (`resumes`), once per
        job: False when one was queued for it already (an extension handed over twice)."""
        if job_id in {t.user_attrs.get(RESUMES) for t in self.study.get_trials(deepcopy=False)}:
            return False
        self.study.enqueue_trial(params, user_attrs={RESUMES: job_id}, skip_if_exists=False)
        return True

    def resumes(self, number: int) -> str | None:
        """The pruned trial's job trial `number` continues, if it was queued by `enqueue_resume`."""
        return self.storage.get_trial(self._trial_id(number)).user_attrs.get(RESUMES)

    def trial_count(self) -> int:
        """Trials asked for (a trial queued by `enqueue_resume` counts once it is asked)."""
        waiting = optuna.trial.TrialState.WAITING
        return sum(1 for t in self.study.get_trials(deepcopy=False) if t.state != waiting)

    def running_params(self) -> dict[int, dict[str, Any]]:
        """Trials asked for and not told: their values (a sweep adopts those it has no row for,
        after a crash between `ask` and recording the trial)."""
        running = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        return {t.number: dict(t.params) for t in running}

    def states(self) -> dict[int, str]:
        return {t.number: t.state.name.lower() for t in self.study.get_trials(deepcopy=False)}

    def best(self) -> Best | None:
        """The best complete trial, as Optuna ranks it; None before one completes."""
        done = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if not done:
            return None
        best = self.study.best_trial
        return Best(best.number, float(best.value), dict(best.params))
