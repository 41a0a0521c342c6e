"""The `elastron` command line.

`train` is the engine's own launcher (the torchrun of this project): it runs a job on N local
processes with no Ray and no service, the quickest way to debug a job. `schema` prints the job
specification's JSON Schema. torch is imported only inside the commands that need it, so the
CLI (and the service that shares this package) starts without it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from engine.jobspec import JobSpecError, json_schema, load_job, parse_job

app = typer.Typer(no_args_is_help=True, add_completion=False, help="elastron: train large transformers.")


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def train(
    job: Annotated[Path, typer.Argument(help="Job file (YAML or JSON).")],
    ranks: Annotated[
        int | None, typer.Option(help="Number of local ranks; overrides resources.ranks.")
    ] = None,
    metrics_out: Annotated[
        Path | None, typer.Option("--metrics-out", help="Write one JSON line per iteration here.")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress lines.")] = False,
) -> None:
    """Run JOB locally on N processes (gloo on CPU, NCCL on CUDA), without Ray or the service."""
    try:
        spec = load_job(job)
        if ranks is not None:
            data = spec.model_dump(mode="json")
            data["resources"]["ranks"] = ranks
            spec = parse_job(data)
        from engine.training import check_supported

        check_supported(spec)
    except JobSpecError as err:
        _fail(f"{job}:\n{err}")
    from engine.device import resolve_device_type
    from engine.launcher import RankFailure, spawn
    from engine.training import train_rank

    try:
        device_type = resolve_device_type(spec.resources.device)
    except RuntimeError as err:
        _fail(str(err))
    n = spec.resources.ranks
    try:
        records = spawn(
            train_rank,
            n,
            (spec.model_dump(mode="json"), str(metrics_out) if metrics_out else None, quiet),
            device_type=device_type,
            timeout_s=float("inf"),
        )[0]
    except RankFailure as err:
        _fail(str(err), code=1)
    except KeyboardInterrupt:
        _fail("interrupted", code=130)
    if records and not quiet:
        first, last = records[0], records[-1]
        typer.echo(
            f"[elastron] done: {len(records)} iterations, loss {first['loss']:.4f} -> {last['loss']:.4f}"
            + (f", metrics in {metrics_out}" if metrics_out else "")
        )


@app.command()
def schema() -> None:
    """Print the job specification's JSON Schema."""
    json.dump(json_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    app()
