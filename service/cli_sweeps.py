"""`elastron sweep submit | status | list | extend | cancel`: hyperparameter sweeps over the API
(service/routers/sweeps.py). Thin HTTP clients like the job commands (service/cli_jobs.py): a
sweep file is YAML or JSON (examples/sweep_lora.yaml), validated by the API, whose 422 names each
bad field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from service.cli_jobs import _api, _client, _read_job_file, app

sweep_app = typer.Typer(
    help="Hyperparameter sweeps: trials drawn by Optuna, run as jobs.", no_args_is_help=True
)
app.add_typer(sweep_app, name="sweep")


def _value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _show(sweep: dict[str, Any]) -> None:
    metric = sweep["metric"]
    typer.echo(
        f"{sweep['id']}  {sweep['state']}  {metric.get('name')} ({metric.get('direction')})  "
        f"trials {len(sweep.get('trials', []))} / {sweep['spec']['budget']['max_trials']}  "
        f"rank-hours {sweep['gpu_hours']:.3f}"
    )
    if sweep.get("message"):
        typer.echo(f"  {sweep['message']}")
    for t in sweep.get("trials", []):
        params = ", ".join(f"{k}={_value(v)}" for k, v in t["params"].items())
        value = "-" if t["value"] is None else f"{t['value']:.5g} @ {t['iteration']}"
        typer.echo(f"  #{t['number']:<3} {t['state']:<9} {value:<18} {t['job_id'] or '-':<28} {params}")
        if t.get("message") and t["state"] == "failed":
            typer.echo(f"       {t['message']}")
    best = sweep.get("best")
    if best:
        params = ", ".join(f"{k}={_value(v)}" for k, v in best["params"].items())
        typer.echo(f"best: #{best['number']} {best['value']:.5g} ({best['job_id']}): {params}")


@sweep_app.command("submit")
def submit(
    path: Annotated[
        Path, typer.Argument(help="A sweep file (YAML or JSON): base, search_space, metric, budget, ...")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's answer as JSON.")] = False,
) -> None:
    """Submit a sweep; its trials are queued as jobs of your tenant."""
    client = _client()
    sweep = _api(client.submit_sweep, _read_job_file(path))
    typer.echo(json.dumps(sweep, indent=2) if as_json else f"submitted {sweep['id']} ({sweep['state']})")


@sweep_app.command("status")
def status(
    sweep_id: Annotated[str, typer.Argument(help="Sweep id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's answer as JSON.")] = False,
) -> None:
    """A sweep's trials (values, state, metric, job) and its best trial."""
    sweep = _api(_client().sweep, sweep_id)
    if as_json:
        typer.echo(json.dumps(sweep, indent=2))
    else:
        _show(sweep)


@sweep_app.command("list")
def list_sweeps() -> None:
    """Your tenant's sweeps, newest first."""
    for s in _api(_client().sweeps)["sweeps"]:
        best = "-" if not s.get("best") else f"{s['best']['value']:.5g}"
        typer.echo(f"{s['id']:<32} {s['state']:<10} trials {s['trials_started']:<4} best {best}")


@sweep_app.command("cancel")
def cancel(sweep_id: Annotated[str, typer.Argument(help="Sweep id.")]) -> None:
    """Stop drawing trials and cancel the running ones."""
    sweep = _api(_client().cancel_sweep, sweep_id)
    typer.echo(f"{sweep['id']}: cancel requested ({sweep['state']} until its trials have stopped)")


@sweep_app.command("extend")
def extend(
    sweep_id: Annotated[str, typer.Argument(help="Sweep id.")],
    max_trials: Annotated[int, typer.Option(help="The new trial budget (above the trials run so far).")],
    resume_pruned: Annotated[
        bool, typer.Option(help="First continue the pruned trials from their checkpoints, best first.")
    ] = False,
) -> None:
    """Raise a sweep's trial budget (it runs again if it had completed)."""
    sweep = _api(_client().extend_sweep, sweep_id, max_trials, resume_pruned)
    typer.echo(f"{sweep['id']}: {sweep['message']} ({sweep['state']})")
