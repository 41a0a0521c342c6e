"""Following a job from the terminal: its driver log (the lines a person reads: service/log_lines.py) streamed above a progress bar (iteration /
train_iters, loss, tokens/s, the API's ETA) fed by the metrics endpoint, and the
end-of-run summary of `elastron demo`."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import typer

from service.client import ApiClient, ApiError
from service.log_lines import LineFilter

FINAL = ("succeeded", "failed", "cancelled")


def api_call(call, *args: Any, **kwargs: Any) -> Any:
    """Run a client call; on failure print the API's message and exit (2 for a 422, else 1)."""
    try:
        return call(*args, **kwargs)
    except ApiError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2 if err.status == 422 else 1) from None


def fmt(value: Any, spec: str = ".4f") -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def eta(seconds: Any) -> str:
    """The API's `eta_s` as H:MM:SS ('-' when it has none)."""
    if not isinstance(seconds, int | float):
        return "-"
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 3600:.0f} h"


def _stream_logs(
    client: ApiClient, job_id: str, console, stop: threading.Event, raw_log: Path | None, verbose: bool
) -> None:
    """Every chunk goes to `raw_log`; the console gets the lines a person reads (service/log_lines.py),
    or everything with `verbose`."""
    lines = LineFilter()

    def show(text: str) -> None:
        console.print(text, end="", markup=False, highlight=False, soft_wrap=True)

    raw = raw_log.open("a", encoding="utf-8") if raw_log is not None else None
    try:
        for chunk in client.follow_logs(job_id):
            if raw is not None:
                raw.write(chunk)
                raw.flush()
            if stop.is_set():
                return
            if verbose:
                show(chunk)
            else:
                for line in lines.feed(chunk):
                    show(line + "\n")
        for line in [] if verbose else lines.flush():
            show(line + "\n")
    except ApiError as err:
        if not stop.is_set():
            console.print(f"[elastron] logs unavailable: {err}", markup=False, style="yellow")
    finally:
        if raw is not None:
            raw.close()


def follow(
    client: ApiClient, job_id: str, log_dir: Path | None = None, verbose: bool = False
) -> dict[str, Any]:
    """Stream the job's log above a progress bar fed by the metrics endpoint, until the job ends.
    Without `verbose` Ray's own lines and the raw event lines are left out of the terminal; the
    whole log goes to `log_dir/<job id>.log` either way."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    job = api_call(client.job, job_id)
    console = Console(stderr=False)
    stop = threading.Event()
    raw_log = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        raw_log = log_dir / f"{job_id}.log"
        if not verbose:
            console.print(
                f"[elastron] the full log (Ray's lines and events too): {raw_log}; --verbose prints it here",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} it"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("ETA {task.fields[eta]}"),
        TextColumn("[{task.fields[state]}]"),
    )
    records: list[dict[str, Any]] = []
    after = -1
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(
            job_id, total=job["train_iters"], loss="-", tps="-", eta="-", state=job["state"]
        )
        logs = threading.Thread(
            target=_stream_logs,
            args=(client, job_id, progress.console, stop, raw_log, verbose),
            daemon=True,
        )
        logs.start()
        while True:
            page = api_call(client.metrics, job_id, after=after, limit=5000)
            if page["records"]:
                records = (records + page["records"])[-100:]
                after = page["records"][-1]["iteration"]
            job = api_call(client.job, job_id)
            done = job["iteration"] or 0
            last = job["last_metrics"] or (records[-1] if records else {})
            progress.update(
                task,
                completed=done,
                loss=fmt(last.get("loss")),
                tps=fmt(last.get("tokens_per_s"), ".0f"),
                eta=eta(job.get("eta_s")),
                state=job["state"],
            )
            if job["state"] in FINAL:
                break
            time.sleep(1.0)
        logs.join(timeout=5.0)  # the stream ends by itself once the job has: let it print the rest
    stop.set()
    if job["state"] != "succeeded":
        cause = f": {job['failure_cause']}" if job.get("failure_cause") else ""
        typer.secho(f"{job_id} {job['state']}{cause}", fg=typer.colors.RED, err=True)
    return job


def summary(client: ApiClient, job: dict[str, Any], records: list[dict[str, Any]]) -> None:
    api = client.config.url
    last = records[-1] if records else (job["last_metrics"] or {})
    rates = [r["tokens_per_s"] for r in records if isinstance(r.get("tokens_per_s"), int | float)]
    energy = [r["energy_j"] for r in records if isinstance(r.get("energy_j"), int | float)]
    ckpt = job["latest_checkpoint"]
    root = (job["spec"].get("checkpoint") or {}).get("path")
    where = "none"
    if ckpt and ckpt.get("uri"):
        where = ckpt["uri"]
    elif root:  # no checkpoint_saved event: where the workers put this job's checkpoints
        where = f"{root.rstrip('/')}/{job['id']}"
    typer.echo("")
    typer.echo(
        f"job {job['id']}: {job['state']} after {job['iteration'] or 0}/{job['train_iters']} iterations"
    )
    typer.echo(f"  final loss    {fmt(last.get('loss'))}")
    typer.echo(
        f"  tokens/s      {fmt(sum(rates) / len(rates), '.0f') if rates else '-'} (mean over {len(rates)} steps)"
    )
    typer.echo(
        f"  energy        {fmt(sum(energy), '.1f') + ' J' if energy else 'unavailable on this machine'}"
    )
    typer.echo(f"  checkpoint    {where}")
    typer.echo(f"  web UI        {api}/ui#/jobs/{job['id']}")
    typer.echo(f"  API           {api}/v1/jobs/{job['id']}   (docs: {api}/docs)")
    typer.echo(f"  Prometheus    {api}/metrics")
    sys.stdout.flush()
