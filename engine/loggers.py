"""Step records to the tools people already read: TensorBoard, MLflow, Weights & Biases
(`training.loggers: [tensorboard, mlflow, wandb]`, any subset; each library an optional extra:
`pip install 'elastron[tensorboard]'`, `[mlflow]`, `[wandb]`).

Written from rank 0, next to the metrics file, by `engine.train_loop`: rank 0 is where the
record is made, on every launch path (`elastron train` has no driver; on Ray the driver never
sees the records, they go from rank 0 to the API), so one writer and no extra hop. A restarted
rank 0 reopens the same run (TensorBoard: the same folder; MLflow: the run tagged with the job;
W&B: the run whose id is the job's) and writes the redone steps again.

Where each writes, by the tool's own conventions:
- TensorBoard: `$ELASTRON_TENSORBOARD_DIR/<run>` when set, else `<checkpoint.path>/tensorboard`
  (the job's own folder when the service runs it), else `runs/<run>/tensorboard`. Scalars by tag
  (TAGS below), step = iteration.
- MLflow: `MLFLOW_TRACKING_URI` (else a SQLite store in the folder above, `mlflow.db`), experiment
  `MLFLOW_EXPERIMENT_NAME` (else "elastron"); the job spec as params (dotted keys), the records as
  metrics by step.
- W&B: project `WANDB_PROJECT` (else "elastron"), the spec as config, the records as history by
  step; offline (files under `WANDB_DIR`, else the folder above) when no `WANDB_API_KEY` is set
  and `WANDB_MODE` says nothing else.

A logger that fails while training (a full disk, a tracking server gone) is reported once on
stderr and dropped: the training goes on. One that cannot start (its library missing) stops the
job at the start with the extra to install.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

# Record field -> the name each tool shows (Megatron-Core's TensorBoard grouping: train/, valid/).
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "step_time_s": "train/step_time_s",
    "loss_scale": "train/loss_scale",
    "mtp_loss": "train/mtp_loss",
    "energy_j": "train/energy_j",
    "power_w": "train/power_w",
    "memory_peak_bytes": "train/memory_peak_bytes",
    "valid_loss": "valid/loss",
    "valid_ppl": "valid/ppl",
}
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
_MODULES = {"tensorboard": "torch.utils.tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers under their tags (missing, non-finite and non-numeric left out)."""
    out = {}
    for field, tag in TAGS.items():
        value = record.get(field)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        out[tag] = float(value)
    return out


def flat_params(spec: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The job spec as dotted keys -> strings (MLflow params; W&B keeps the nested config)."""
    out: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, name + "."))
        else:
            out[name] = str(value)[:6000]  # MLflow's limit on a param's value
    return out


def log_root(spec: dict[str, Any], run: str) -> Path:
    env = os.environ.get("ELASTRON_TENSORBOARD_DIR")
    if env:
        return Path(env) / run
    path = (spec.get("checkpoint") or {}).get("path")
    if path and "://" not in path:
        return Path(path)
    return Path("runs") / run


class _TensorBoard:
    def __init__(self, spec: dict[str, Any], run: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = log_root(spec, run) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.logdir))
        self.writer.add_text("job/spec", "```\n" + _yamlish(spec) + "\n```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    BATCH = 50  # records per log_batch call (MLflow takes 1000 metrics per call)

    def __init__(self, spec: dict[str, Any], run: str) -> None:
        from mlflow.tracking import MlflowClient

        default = log_root(spec, run).resolve()
        default.mkdir(parents=True, exist_ok=True)  # MLflow 3's own default: a SQLite store
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{default / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "elastron"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`elastron.job` = '{run}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id  # a restart: the same run goes on
        else:
            self.run_id = self.client.create_run(experiment_id, tags={"elastron.job": run}, run_name=run).info.run_id
            from mlflow.entities import Param

            params = [Param(k, v) for k, v in flat_params(spec).items()]
            for start in range(0, len(params), 100):  # MLflow takes 100 params per call
                self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.pending: list = []

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(tag, value, now, step) for tag, value in values.items()]
        if len(self.pending) >= self.BATCH * max(1, len(values)):
            self.flush()

    def flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[:1000], self.pending[1000:]
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id)


class _WandB:
    def __init__(self, spec: dict[str, Any], run: str) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        root = Path(os.environ.get("WANDB_DIR") or log_root(spec, run))
        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "elastron",
            name=run,
            id=_wandb_id(run),
            resume="allow",
            config=spec,
            mode=mode,
            dir=str(root),
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            reinit="create_new",
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_KINDS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}


def require(names: list[str]) -> None:
    """Raise, naming the extra to install, when a named logger's library is missing. Every rank
    calls it before training, so all stop alike instead of waiting on rank 0 in a collective."""
    for name in names:
        try:
            importlib.import_module(_MODULES[name])
        except ImportError as err:
            raise RuntimeError(
                f"training.loggers names {name}, but its library is not installed here ({err}): "
                f"pip install 'elastron[{EXTRAS[name]}]', or take {name} out of training.loggers"
            ) from None


class Loggers:
    """The job's loggers (none: every call is a no-op). `log(record)` per step, `close()` at the end."""

    def __init__(self, spec: dict[str, Any], names: list[str], run: str) -> None:
        require(names)
        self.active: dict[str, Any] = {}
        try:
            for name in names:
                self.active[name] = _KINDS[name](spec, run)
        except BaseException:
            self.close()  # the ones already open (a W&B run, its service process)
            raise

    def log(self, record: dict[str, Any]) -> None:
        if isinstance(record.get("iteration"), int):
            self.log_values(record["iteration"], scalars(record))

    def log_values(self, step: int, values: dict[str, float]) -> None:
        """Scalars by tag at `step` (a step record's, or an evaluation's `eval/<task>/<metric>`)."""
        values = {k: v for k, v in values.items() if isinstance(v, int | float) and math.isfinite(v)}
        if not values:
            return
        for name, logger in list(self.active.items()):
            self._guard(name, logger.log, step, values)

    def close(self) -> None:
        for name, logger in list(self.active.items()):
            self._guard(name, logger.close)
        self.active.clear()

    def _guard(self, name: str, call, *args: Any) -> None:
        try:
            call(*args)
        except Exception as err:  # noqa: BLE001 - a logger never stops the training
            print(f"[elastron] logger {name} failed and is off for the rest of this run: {err!r}", file=sys.stderr)
            self.active.pop(name, None)


def open_loggers(spec: dict[str, Any], job_id: str | None) -> Loggers:
    """The loggers `training.loggers` names, for the run called `job_id` (else the job's name)."""
    names = list((spec.get("training") or {}).get("loggers") or [])
    return Loggers(spec, names, job_id or spec.get("name") or "job")


def _wandb_id(run: str) -> str:
    """W&B run ids take letters, digits, '-' and '_' (at most 128)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run)[:128]


def _yamlish(spec: dict[str, Any], indent: str = "") -> str:
    lines = []
    for key, value in spec.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines.append(_yamlish(value, indent + "  "))
        else:
            lines.append(f"{indent}{key}: {value}")
    return "\n".join(line for line in lines if line)
