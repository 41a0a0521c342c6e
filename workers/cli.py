"""The workers' command: `worker-run`, the process Ray Jobs starts per job (the service's
launcher names it in the Ray job's entrypoint). Ray is imported only when it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from engine.cli import fail
from engine.jobspec import JobSpecError

app = typer.Typer()


@app.command("worker-run")
def worker_run(
    job_id: Annotated[
        str, typer.Argument(help="The job's id: the Ray Train run name and the checkpoint namespace.")
    ],
    spec: Annotated[
        Path | None,
        typer.Option(help="Job file (YAML or JSON); default: the JSON in $ELASTRON_JOB_SPEC."),
    ] = None,
    address: Annotated[
        str | None, typer.Option(help="Ray address; default: $RAY_ADDRESS, else a running or new local Ray.")
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option(help="Ray Train run storage; default: $ELASTRON_RAY_STORAGE or ~/ray_results."),
    ] = None,
    metrics_out: Annotated[
        Path | None, typer.Option("--metrics-out", help="Rank 0 also writes its records here (on its node).")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress lines from rank 0.")] = False,
) -> None:
    """Run job JOB_ID on the Ray cluster until it is done: the process Ray Jobs starts per job.

    Restarts the ranks from the newest checkpoint after a failure (resilience.max_restarts),
    resizes elastic jobs, acts on the rerun exit codes, and sends metrics and events to
    $ELASTRON_API_URL (see workers/README.md). SIGINT or SIGTERM cancels gracefully.
    Exit codes: 0 done, 1 failed, 2 bad input, 16 needs other hardware the cluster lacks,
    17 result validation failed, 130 cancelled."""
    from workers.driver import WorkerRunOptions, run_job
    from workers.placement import placement_from_env
    from workers.spec_on_ray import JobInputError, load_spec

    try:
        job = load_spec(spec)
    except (JobSpecError, JobInputError) as err:
        fail(f"{spec or 'ELASTRON_JOB_SPEC'}:\n{err}")
    options = WorkerRunOptions(
        address=address,
        storage_path=storage,
        metrics_out=str(metrics_out) if metrics_out else None,
        quiet=quiet,
        placement=placement_from_env(),
    )
    result = run_job(job_id, job, options)
    if result.exit_code:
        fail(result.reason, code=result.exit_code)
    typer.echo(f"[elastron] {job_id}: {result.reason} after {result.attempts} attempt(s)")
