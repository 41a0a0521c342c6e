"""A sweep's Optuna study (service/sweeps/study.py): ASHA stops the trials whose curves fall behind
at a rung, the best trial is Optuna's, a study reopened after an API restart goes on where it was,
a grid is walked once, and the study's tables stay out of the store's own (both use Alembic's
`alembic_version` table), on SQLite and on Postgres."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from service.store.db import make_engine
from service.store.migrate import HEAD, current_revision, upgrade
from service.sweeps.spec import SweepSpec
from service.sweeps.study import STUDY_SCHEMA, SweepStudy, study_storage

ITERS = 27
BASE = {"name": "base", "training": {"train_iters": ITERS, "global_batch_size": 4, "micro_batch_size": 2}}


def spec(**over) -> SweepSpec:
    return SweepSpec.model_validate(
        {
            "base": BASE,
            "search_space": {"optimizer.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
            "budget": {"max_trials": 16},
            "metric": {"name": "loss"},
            "sampler": {"name": "random", "seed": 3},
            **over,
        }
    )


def run_trial(study: SweepStudy, scale: float) -> int | None:
    """A trial whose loss is scale / iteration: the iteration the pruner stopped it at, or None."""
    number, _ = study.ask()
    for it in range(1, ITERS + 1):
        if study.report(number, it, scale / it):
            study.pruned(number)
            return it
    study.complete(number, scale / ITERS)
    return None


def test_asha_stops_the_curves_that_fall_behind_at_a_rung_and_the_best_is_optunas(tmp_path):
    study = SweepStudy.open(spec(), "s1", study_storage(f"sqlite:///{tmp_path}/elastron.db"), ITERS)
    stopped = {scale: run_trial(study, scale) for scale in (1.0, 0.8, 1.2, 5.0, 0.5)}
    # The first trials have nothing to lose to; a curve 5x above them is stopped at the first rung
    # (min_resource 1, reduction 3: rungs at 1, 3, 9, 27 iterations); 0.5 beats all and completes.
    assert stopped[1.0] is None and stopped[0.8] is None and stopped[0.5] is None
    assert stopped[5.0] == 1
    assert study.states() == {0: "complete", 1: "complete", 2: "pruned", 3: "pruned", 4: "complete"}
    best = study.best()
    assert best.number == 4 and best.value == pytest.approx(0.5 / ITERS)
    assert best.params == study.study.best_trial.params and set(best.params) == {"optimizer.lr"}


def test_without_a_pruner_every_trial_runs_to_its_end(tmp_path):
    study = SweepStudy.open(spec(pruner={"name": "none"}), "s2", study_storage(f"sqlite:///{tmp_path}/e.db"), ITERS)
    assert [run_trial(study, s) for s in (1.0, 5.0, 9.0)] == [None, None, None]


def test_a_reopened_study_goes_on_with_its_running_trial(tmp_path):
    url = f"sqlite:///{tmp_path}/elastron.db"
    first = SweepStudy.open(spec(), "s3", study_storage(url), ITERS)
    done = run_trial(first, 1.0)
    number, values = first.ask()
    assert not first.report(number, 1, 0.9)

    again = SweepStudy.open(spec(), "s3", study_storage(url), ITERS)  # the API restarted
    assert again.states() == {0: "complete", 1: "running"} and done is None
    assert again.study.trials[1].params == values
    assert not again.report(number, 3, 0.3)
    again.complete(number, 0.01)
    assert again.states() == {0: "complete", 1: "complete"}
    assert again.study.trials[1].intermediate_values == {1: 0.9, 3: 0.3}
    assert again.best().number == 1


def test_the_same_seed_draws_the_same_trials(tmp_path):
    url = f"sqlite:///{tmp_path}/elastron.db"
    a = SweepStudy.open(spec(), "a", study_storage(url), ITERS)
    b = SweepStudy.open(spec(), "b", study_storage(url), ITERS)
    assert [a.ask()[1] for _ in range(4)] == [b.ask()[1] for _ in range(4)]


def test_a_grid_sweep_draws_every_combination_once(tmp_path):
    grid = spec(
        sampler={"name": "grid", "seed": 1},
        search_space={
            "training.global_batch_size": {"type": "choice", "values": [4, 8]},
            "optimizer.lr": {"type": "float", "low": 0.001, "high": 0.003, "step": 0.001},
        },
    )
    study = SweepStudy.open(grid, "g", study_storage(f"sqlite:///{tmp_path}/elastron.db"), ITERS)
    drawn = []
    for _ in range(6):
        number, values = study.ask()
        drawn.append((values["training.global_batch_size"], round(values["optimizer.lr"], 6)))
        study.complete(number, 1.0)
    assert sorted(drawn) == [(b, lr) for b in (4, 8) for lr in (0.001, 0.002, 0.003)]


def test_on_sqlite_the_study_is_a_file_beside_the_store_and_both_keep_their_versions(tmp_path):
    url = f"sqlite:///{tmp_path}/elastron.db"
    engine = make_engine(url)
    upgrade(engine)
    SweepStudy.open(spec(), "s", study_storage(url), ITERS).ask()
    assert current_revision(engine) == HEAD  # the store's Alembic version is its own
    assert (tmp_path / "elastron.optuna.db").exists()
    assert "trials" not in sa.inspect(engine).get_table_names()
    engine.dispose()
    with pytest.raises(ValueError, match="in-memory SQLite"):
        study_storage("sqlite://")


def test_on_postgres_the_study_is_a_schema_of_the_stores_database(fresh_pg_db):
    engine = make_engine(fresh_pg_db)
    upgrade(engine)
    study = SweepStudy.open(spec(), "pg", study_storage(fresh_pg_db), ITERS)
    run_trial(study, 1.0)
    assert current_revision(engine) == HEAD
    inspect = sa.inspect(engine)
    assert "trials" in inspect.get_table_names(schema=STUDY_SCHEMA)
    assert "trials" not in inspect.get_table_names()  # the store's schema holds the store's tables only
    engine.dispose()
    reopened = SweepStudy.open(spec(), "pg", study_storage(fresh_pg_db), ITERS)
    assert reopened.states() == {0: "complete"}
