"""`training.loggers` (engine/loggers.py): rank 0 writes each step's record to TensorBoard, MLflow
and W&B, and the tests read them back with each library's own reader (TensorBoard's
EventAccumulator, MLflow's client, `wandb leet inspect` on the offline run's .wandb file). A
library that is not installed skips its test naming it; asking for it in a job then stops the
job at the start naming the extra to install."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import loggers
from engine.jobspec import JobSpec, JobSpecError, parse_job
from engine.launcher import spawn
from engine.rank_hooks import RankIdentity
from engine.train_loop import train_rank
from tests.engine.parallel_harness import job
from tests.tools import missing_tool

ITERS = 5


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _train(spec: dict) -> list[dict]:
    return train_rank(spec, quiet=True, identity=RankIdentity(node_id="n", job_id="run-7", rank=None))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 1-rank job with every installed logger; returns (checkpoint folder, rank 0's records)."""
    names = [n for n, module in loggers._MODULES.items() if not _missing(module.split(".")[0])]
    if not names:
        missing_tool("tensorboard, mlflow, wandb", "none is installed (pip install 'elastron[tensorboard,mlflow,wandb]')")
    root = tmp_path_factory.mktemp("loggers")
    spec = job(1, training={"train_iters": ITERS, "loggers": names}, checkpoint={"path": str(root)})
    with pytest.MonkeyPatch.context() as mp:  # the defaults: W&B offline, files in the job's folder
        for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI", "ELASTRON_TENSORBOARD_DIR"):
            mp.delenv(name, raising=False)
        records = spawn(_train, 1, (spec,), timeout_s=240)[0]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    return root, records


def test_tensorboard_scalars_by_tag(trained):
    if _missing("tensorboard"):
        missing_tool("tensorboard", "pip install 'elastron[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, records = trained
    acc = EventAccumulator(str(root / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_time_s"} <= set(
        acc.Tags()["scalars"]
    )
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["iteration"] for r in records]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_mlflow_params_from_the_spec_and_metrics_by_step(trained):
    if _missing("mlflow"):
        missing_tool("mlflow", "pip install 'elastron[mlflow]'")
    from mlflow.tracking import MlflowClient

    root, records = trained
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("elastron")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["elastron.job"] == "run-7" and run.info.status == "FINISHED"
    assert run.data.params["training.train_iters"] == str(ITERS) and run.data.params["resources.ranks"] == "1"
    history = client.get_metric_history(run.info.run_id, "train/lr")
    assert [(m.step, m.value) for m in history] == [(r["iteration"], pytest.approx(r["lr"])) for r in records]


def test_wandb_offline_config_and_history(trained):
    if _missing("wandb"):
        missing_tool("wandb", "pip install 'elastron[wandb]'")
    root, records = trained
    (run_file,) = (root / "wandb").glob("offline-run-*/run-run-7.wandb")
    wandb_cli = Path(sys.executable).parent / "wandb"
    out = subprocess.run(
        [str(wandb_cli) if wandb_cli.exists() else shutil.which("wandb"), "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    entries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    (run,) = [e["run"] for e in entries if e["type"] == "run"]
    assert run["run_id"] == "run-7" and run["config"]["update"]["training"]["train_iters"] == ITERS
    history = [e["history"] for e in entries if e["type"] == "history"]
    assert [h["step"]["num"] for h in history] == [r["iteration"] for r in records]
    assert [h["item"]["train/loss"] for h in history] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_a_missing_library_names_its_extra(monkeypatch):
    monkeypatch.setitem(loggers._MODULES, "mlflow", "no_such_module_for_mlflow")
    with pytest.raises(RuntimeError, match=r"pip install 'elastron\[mlflow\]', or take mlflow out of training.loggers"):
        loggers.require(["mlflow"])


def test_the_spec_field():
    assert JobSpec.model_validate({}).training.loggers == []
    with pytest.raises(JobSpecError, match="training.loggers"):
        parse_job({"training": {"loggers": ["tensorboard", "tensorboard"]}})
    with pytest.raises(JobSpecError, match="training.loggers"):
        parse_job({"training": {"loggers": ["comet"]}})


def test_a_restarted_rank_continues_the_same_mlflow_run(tmp_path, monkeypatch):
    if _missing("mlflow"):
        missing_tool("mlflow", "pip install 'elastron[mlflow]'")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("ELASTRON_TENSORBOARD_DIR", raising=False)
    spec = {"name": "r", "training": {"train_iters": 4}, "checkpoint": {"path": str(tmp_path)}}
    for steps in ([1, 2], [2, 3, 4]):  # the second attempt redoes step 2 after a restart
        run = loggers.Loggers(spec, ["mlflow"], "job-r")
        for step in steps:
            run.log({"iteration": step, "loss": 1.0 / step})
        run.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("elastron").experiment_id])
    assert sorted({m.step for m in client.get_metric_history(found.info.run_id, "train/loss")}) == [1, 2, 3, 4]
