"""A sweep's search space (service/sweeps/space.py) and spec checks (spec.py): every path and value
checked against the job spec's own rules, each problem naming its field; grids; one draw through
an Optuna trial."""

from __future__ import annotations

import optuna
import pytest
from pydantic import TypeAdapter, ValidationError

from engine.jobspec import hf_config, parse_job
from service.sweeps.space import SearchSpace, field_problem, grid, space_problems, suggest, with_values
from service.sweeps.spec import SweepSpec, sweep_problems

BASE = {
    "name": "base",
    "training": {"train_iters": 20, "global_batch_size": 4, "micro_batch_size": 2},
    "resources": {"ranks": 2},
}


def space(raw: dict) -> SearchSpace:
    return TypeAdapter(SearchSpace).validate_python(raw)


def fields(problems: list[tuple[str, str]]) -> list[str]:
    return [f for f, _ in problems]


def test_paths_name_fields_of_the_job_spec_and_nothing_else():
    assert field_problem("optimizer.lr") is None
    assert field_problem("model.lora.rank") is None  # a section that is None until set
    assert "known fields there: type, lr," in field_problem("optimizer.lrr")
    assert "the job spec has no field 'optimiser'" in field_problem("optimiser.lr")
    assert "is a section, not a field" in field_problem("optimizer")
    assert "is a field, not a section" in field_problem("optimizer.lr.value")


def test_every_bound_and_choice_the_job_spec_refuses_is_named_with_its_reason():
    problems = space_problems(
        BASE,
        space(
            {
                "optimizer.lr": {"type": "float", "low": -1, "high": 1e-2, "log": False},
                "training.global_batch_size": {"type": "choice", "values": [4, 6, 8]},
                "optimizer.lrr": {"type": "float", "low": 1, "high": 2},
                "model.lora.rank": {"type": "int", "low": 0, "high": 16},
            }
        ),
    )
    assert fields(problems) == [
        "search_space.optimizer.lr.low",
        "search_space.training.global_batch_size.values[1]",
        "search_space.optimizer.lrr",
        "search_space.model.lora.rank.low",
    ]
    message = dict(problems)["search_space.training.global_batch_size.values[1]"]
    assert "= 6 is refused by the job spec" in message and "not divisible" in message


def test_a_space_the_job_spec_accepts_has_no_problem_and_makes_valid_trials():
    ok = space(
        {
            "optimizer.lr": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True},
            "training.global_batch_size": {"type": "choice", "values": [4, 8]},
            "model.lora.rank": {"type": "int", "low": 2, "high": 16, "log": True},
        }
    )
    assert space_problems(BASE, ok) == []
    trial = with_values(BASE, {"optimizer.lr": 1e-3, "model.lora.rank": 4})
    spec = parse_job(trial)
    assert spec.optimizer.lr == 1e-3 and spec.model.lora.rank == 4
    assert "lora" not in BASE.get("model", {}) and BASE["training"]["global_batch_size"] == 4  # base untouched


@pytest.mark.parametrize(
    ("raw", "field", "says"),
    [
        ({"type": "float", "low": 2, "high": 1}, "search_space.optimizer.lr.low", "above high"),
        ({"type": "float", "low": 0, "high": 1, "log": True}, "search_space.optimizer.lr.low", "log scale needs low > 0"),
        ({"type": "float", "low": 0.1, "high": 1, "log": True, "step": 0.1}, "search_space.optimizer.lr.step", "both"),
    ],
)
def test_a_range_that_is_no_range_is_refused_before_the_job_spec_is_asked(raw, field, says):
    (problem,) = space_problems(BASE, space({"optimizer.lr": raw}))
    assert problem[0] == field and says in problem[1]


def test_an_empty_space_and_a_bad_parameter_type_are_refused():
    assert fields(space_problems(BASE, {})) == ["search_space"]
    with pytest.raises(ValidationError, match="type"):
        space({"optimizer.lr": {"type": "uniform", "low": 1, "high": 2}})
    with pytest.raises(ValidationError, match="at least 1 item"):
        space({"optimizer.lr": {"type": "choice", "values": []}})


def test_a_grid_is_every_value_of_choices_ints_and_stepped_floats():
    g = grid(
        space(
            {
                "training.global_batch_size": {"type": "choice", "values": [4, 8]},
                "model.lora.rank": {"type": "int", "low": 2, "high": 8, "step": 2},
                "optimizer.lr": {"type": "float", "low": 0.1, "high": 0.3, "step": 0.1},
            }
        ),
        limit=100,
    )
    assert g == {"training.global_batch_size": [4, 8], "model.lora.rank": [2, 4, 6, 8], "optimizer.lr": [0.1, 0.2, 0.3]}
    with pytest.raises(ValueError, match="optimizer.lr: a float range needs a step"):
        grid(space({"optimizer.lr": {"type": "float", "low": 0.1, "high": 0.3}}), limit=100)
    with pytest.raises(ValueError, match="over 10 combinations"):
        grid(space({"model.lora.rank": {"type": "int", "low": 1, "high": 11}}), limit=10)


def test_one_draw_goes_through_the_optuna_trial_under_the_field_paths():
    s = space(
        {
            "optimizer.lr": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True},
            "model.lora.rank": {"type": "int", "low": 2, "high": 16},
            "training.global_batch_size": {"type": "choice", "values": [4, 8]},
        }
    )
    fixed = {"optimizer.lr": 3e-4, "model.lora.rank": 5, "training.global_batch_size": 8}
    assert suggest(optuna.trial.FixedTrial(fixed), s) == fixed
    with pytest.raises(ValueError):  # a value outside the space is Optuna's error, not a silent draw
        suggest(optuna.trial.FixedTrial({**fixed, "training.global_batch_size": 6}), s)


def sweep(**over) -> SweepSpec:
    raw = {
        "base": BASE,
        "search_space": {"optimizer.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        "budget": {"max_trials": 8},
        **over,
    }
    return SweepSpec.model_validate(raw)


def test_a_sweep_whose_metric_pruner_or_grid_cannot_work_is_refused_naming_the_field():
    base = parse_job(BASE)
    problems = dict(
        sweep_problems(
            sweep(sampler={"name": "grid"}, pruner={"name": "asha", "min_resource": 20, "max_resource": 40}), base
        )
    )
    assert set(problems) == {"metric.name", "sampler.name", "pruner.min_resource", "pruner.max_resource"}
    assert "base.training.eval_interval" in problems["metric.name"]
    assert "needs a step" in problems["sampler.name"]
    ok = sweep(metric={"name": "loss"}, pruner={"name": "hyperband", "min_resource": 2})
    assert sweep_problems(ok, base) == []


def test_an_empty_budget_is_refused_by_the_schema():
    with pytest.raises(ValidationError, match="budget.max_trials"):
        sweep(budget={"max_trials": 0})
    with pytest.raises(ValidationError, match="budget"):
        SweepSpec.model_validate({"base": BASE, "search_space": {}})


def test_the_readmes_sweep_file_is_a_sweep_that_can_run():
    """README.md's example sweep file, checked as the API checks one (no problem)."""
    from pathlib import Path

    import yaml

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Hyperparameter sweeps", 1)[1]
    text = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    spec = SweepSpec.model_validate(yaml.safe_load(text))
    assert sweep_problems(spec, parse_job(spec.base)) == []
    assert spec.pruner.name == "asha" and "optimizer.lr" in spec.search_space


def test_the_example_sweep_file_is_a_sweep_that_can_run(tmp_path, monkeypatch):
    """examples/sweep_lora.yaml, checked as the API checks it, on the model folder the example
    script writes (its base job reads model.init_from's config.json)."""
    import subprocess
    import sys
    from pathlib import Path

    from engine.jobspec.yaml_text import load_yaml

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    subprocess.run([sys.executable, str(root / "examples" / "make_tiny_hf_model.py")], check=True, capture_output=True)
    spec = SweepSpec.model_validate(load_yaml((root / "examples" / "sweep_lora.yaml").read_text()))
    base = parse_job(spec.base)  # reads model.init_from's config.json, once
    reads = []
    real = hf_config.load_hf_config
    monkeypatch.setattr(hf_config, "load_hf_config", lambda folder: reads.append(folder) or real(folder))
    assert sweep_problems(spec, base) == []
    assert reads == []  # the probes of 2 bounds and 3 choices read no config again
    assert spec.budget.max_trials >= 8 and spec.pruner.name == "asha"
