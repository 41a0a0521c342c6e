"""The `elastron` commands that talk to the control plane: up, down, token create, submit, jobs
(and jobs export), status, logs, cancel, demo. Composed with the engine's and workers' commands
by elastron/cli.py.

Job commands are thin HTTP clients (service/client.py): they read the API address and token
from ELASTRON_API_URL / ELASTRON_API_TOKEN or from the files `elastron up` writes. Any failure
prints one clear message and exits non-zero (1: the API said no or is unreachable, 2: bad input).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer()
token_app = typer.Typer(help="Manage API tokens (run where the store is reachable).", no_args_is_help=True)
app.add_typer(token_app, name="token")

FINAL = ("succeeded", "failed", "cancelled")
DEMO_JOB = Path(__file__).resolve().parents[1] / "examples" / "llama_tiny_tp2.yaml"


def _fail(message: str, code: int = 1) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _settings():
    from service.settings import Settings

    return Settings()


def _client():
    from service.client import ApiClient, ApiError, resolve_config

    try:
        return ApiClient(resolve_config(_settings()))
    except ApiError as err:
        _fail(str(err))


def _api(call, *args: Any, **kwargs: Any) -> Any:
    from service.cli_follow import api_call

    return api_call(call, *args, **kwargs)


VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose", "-v", help="Print the whole driver log: Ray's own lines and the raw event lines too."
    ),
]


def _follow(client, job_id: str, verbose: bool = False) -> dict[str, Any]:
    """Follow a job; the whole log also goes to ELASTRON_HOME/logs/<job id>.log."""
    from service.cli_follow import follow

    return follow(client, job_id, log_dir=_settings().home / "logs", verbose=verbose)


def _read_job_file(path: Path) -> dict[str, Any]:
    """YAML (or JSON) to the JSON body of POST /v1/jobs; the API validates it."""
    try:
        text = path.read_text()
    except OSError as err:
        _fail(f"cannot read job file {path}: {err.strerror}", code=2)
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            _fail(f"{path} is not valid JSON: {err}", code=2)
    else:
        import yaml

        from engine.jobspec.yaml_text import load_yaml

        try:
            data = load_yaml(text)
        except yaml.YAMLError as err:
            _fail(f"{path} is not valid YAML: {err}", code=2)
    if not isinstance(data, dict):
        _fail(f"{path}: a job file is a mapping with sections name, model, parallel, ...", code=2)
    return data


# -- local stack ------------------------------------------------------------------------------


@app.command()
def up(
    port: Annotated[int | None, typer.Option(help="API port (default 8000, or a free one).")] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(help="Use this Ray cluster's Jobs API (http://host:8265) instead of a local head."),
    ] = None,
    ray_dashboard_port: Annotated[
        int | None, typer.Option(help="Local Ray dashboard port (default 8265, or a free one).")
    ] = None,
) -> None:
    """Start a local Ray head and the API in the background (state in ELASTRON_HOME, default ~/.elastron)."""
    from service.local_stack import StackError
    from service.local_stack import up as stack_up

    settings = _settings()
    try:
        info = stack_up(
            settings,
            port=port,
            ray_address=ray_address,
            ray_dashboard_port=ray_dashboard_port,
            echo=typer.echo,
        )
    except StackError as err:
        _fail(str(err))
    typer.echo(("elastron is up" if info.started else "elastron was already up") + f" (state in {info.home})")
    typer.echo(
        f"  API        {info.api_url}   (docs: {info.api_url}/docs, Prometheus: {info.api_url}/metrics)"
    )
    typer.echo(f"  web UI     {info.api_url}/ui   (sign in with the token below)")
    typer.echo(f"  Ray        {info.ray_address}")
    typer.echo(
        f'  token      {info.token_file}   (the CLI reads it; curl: -H "Authorization: Bearer $(cat {info.token_file})")'
    )
    typer.echo(f"  logs       {info.home / 'api.log'}, {info.home / 'ray.log'}")


@app.command()
def down() -> None:
    """Stop the API and the Ray head that `elastron up` started (the store and token stay)."""
    from service.local_stack import down as stack_down

    if not stack_down(_settings(), echo=typer.echo):
        typer.echo("nothing was running")


@token_app.command("create")
def token_create(
    tenant: Annotated[str, typer.Option(help="The tenant the token acts for.")],
    admin: Annotated[bool, typer.Option(help="Admin tokens see and cancel every tenant's jobs.")] = False,
) -> None:
    """Create a bearer token (stored hashed; printed once) in the store at ELASTRON_DATABASE_URL."""
    from sqlalchemy.exc import SQLAlchemyError

    from service.store.tokens import create_token

    try:
        principal, secret = create_token(_store(), tenant, admin=admin)
    except ValueError as err:
        _fail(f"--tenant: {err}", code=2)
    except SQLAlchemyError as err:
        _fail(f"cannot write to the store: {err}")
    typer.echo(secret)
    kind = "admin token" if admin else "token"
    typer.echo(
        f"{kind} {principal.token_id} for tenant {tenant!r}; use it as ELASTRON_API_TOKEN "
        "(it is not shown again)",
        err=True,
    )


def _store():
    from sqlalchemy.exc import SQLAlchemyError

    from service.store.db import make_engine, make_sessionmaker
    from service.store.migrate import upgrade

    settings = _settings()
    try:
        engine = make_engine(settings.resolved_database_url)
        upgrade(engine)
    except SQLAlchemyError as err:
        _fail(f"cannot open the store {settings.resolved_database_url}: {err}")
    return make_sessionmaker(engine)


@token_app.command("list")
def token_list() -> None:
    """List tokens (ids, tenants, admin, revoked); the secrets are not stored, so not shown."""
    from service.store.tokens import list_tokens

    for t in list_tokens(_store()):
        flags = ("admin " if t.admin else "") + ("revoked" if t.revoked_at else "")
        typer.echo(f"{t.id}  {t.tenant:<24} {flags}")


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="The token's id (tok_..., from `token list`).")],
) -> None:
    """Revoke a token; API calls with it fail within seconds."""
    from service.store.tokens import revoke_token

    if not revoke_token(_store(), token_id):
        _fail(f"no active token {token_id!r} (see `elastron token list`)", code=2)
    typer.echo(f"revoked {token_id}")


# -- jobs -------------------------------------------------------------------------------------


@app.command()
def submit(
    job: Annotated[Path, typer.Argument(help="Job file (YAML or JSON), the same as for `elastron train`.")],
    idempotency_key: Annotated[
        str | None, typer.Option(help="Retrying with the same key returns the same job.")
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Then follow it like `elastron logs -f`.")
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Submit JOB to the API; prints the job id."""
    spec = _read_job_file(job)
    client = _client()
    created = _api(client.submit, spec, idempotency_key)
    typer.echo(created["id"])
    if follow:
        final = _follow(client, created["id"], verbose)
        raise typer.Exit(0 if final["state"] == "succeeded" else 1)


jobs_app = typer.Typer(help="List your jobs; `jobs export` exports a checkpoint of one.")
app.add_typer(jobs_app, name="jobs")


@jobs_app.callback(invoke_without_command=True)
def jobs(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int, typer.Option(help="Jobs to show, newest first.")] = 20,
) -> None:
    """List your jobs (an admin token: everyone's)."""
    if ctx.invoked_subcommand is not None:
        return
    client = _client()
    page = _api(client.jobs, state=state, limit=limit)
    if not page["jobs"]:
        typer.echo("no jobs")
        return
    from service.cli_follow import eta

    typer.echo(f"{'ID':<40} {'STATE':<11} {'PROGRESS':>13} {'%':>4} {'ETA':>8} {'RESTARTS':>8}  CREATED")
    for j in page["jobs"]:
        progress = f"{j['iteration'] or 0}/{j['train_iters']}"
        pct = f"{100 * j['progress']:.0f}" if j.get("progress") is not None else "-"
        typer.echo(
            f"{j['id']:<40} {j['state']:<11} {progress:>13} {pct:>4} {eta(j.get('eta_s')):>8} "
            f"{j['restarts']:>8}  {j['created_at'][:19]}"
        )
    if page["next_cursor"]:
        typer.echo(f"(more: --limit {limit * 2})")


@jobs_app.command("export")
def jobs_export(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    iteration: Annotated[
        int, typer.Argument(help="The checkpoint's iteration (`elastron status` shows the newest).")
    ],
    output: Annotated[
        str | None,
        typer.Option(
            help="s3:// URI or a local folder under the service's roots (default: <checkpoint>-<format>)."
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="Weights dtype: bf16, fp16 or fp32.")] = "bf16",
    wait: Annotated[
        bool, typer.Option(help="Wait until the export has finished; exit 1 if it failed.")
    ] = False,
    format: Annotated[
        str,
        typer.Option(
            "--format",
            help="hf (a Hugging Face model folder); for a LoRA job: peft (its adapters) or hf-merged-lora.",
        ),
    ] = "hf",
) -> None:
    """Export a job's checkpoint to a Hugging Face model folder (or a LoRA job's adapters as a PEFT
    folder), on the cluster; prints the export id and status (and, with --wait, how it ended)."""
    client = _client()
    export = _api(client.export_checkpoint, job_id, iteration, output=output, dtype=dtype, format=format)
    typer.echo(f"{export['id']}  {export['status']}  iteration {export['iteration']} -> {export['output']}")
    if not wait:
        return
    while export["status"] in ("pending", "running"):
        time.sleep(1.0)
        export = _api(client.export, job_id, export["id"])
    typer.echo(
        f"{export['id']}  {export['status']}" + (f": {export['message']}" if export["message"] else "")
    )
    raise typer.Exit(0 if export["status"] == "succeeded" else 1)


@app.command()
def status(job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """A job's state, progress, last metrics, checkpoint, failure cause and recent events."""
    client = _client()
    job = _api(client.job, job_id)
    from service.cli_follow import fmt

    m = job["last_metrics"] or {}
    typer.echo(f"{job['id']}  ({job['name']}, tenant {job['tenant']})")
    typer.echo(
        f"  state        {job['state']}"
        + ("  (cancel requested)" if job["cancel_requested_at"] and job["state"] not in FINAL else "")
    )
    if job.get("waiting_reason"):
        position = f"#{job['queue_position']}: " if job.get("queue_position") else ""
        typer.echo(f"  queue        {position}{job['waiting_reason']}")
    from service.cli_follow import eta

    pct = f" ({100 * job['progress']:.0f}%)" if job.get("progress") is not None else ""
    typer.echo(
        f"  progress     {job['iteration'] or 0}/{job['train_iters']} iterations{pct}, ETA {eta(job.get('eta_s'))}, "
        f"{job['restarts']} restarts ({job.get('restart_s') or 0:.0f} s restarting)"
    )
    if m:
        typer.echo(
            f"  last step    loss {fmt(m.get('loss'))}, {fmt(m.get('tokens_per_s'), '.0f')} tokens/s, "
            f"{fmt(m.get('step_time_s'), '.3f')} s/step"
        )
    ckpt = job["latest_checkpoint"]
    if ckpt:
        typer.echo(f"  checkpoint   iteration {ckpt['iteration']}: {ckpt['uri']}")
    if job["failure_cause"]:
        typer.echo(f"  failure      {job['failure_cause']}")
    typer.echo(
        f"  created      {job['created_at']}"
        + (f", finished {job['finished_at']}" if job["finished_at"] else "")
    )
    events = _api(client.events, job_id, limit=5000)["events"][-8:]
    if events:
        typer.echo("  events")
        for e in events:
            typer.echo(f"    {e['time'][:19]}  {e['kind']:<17} {e['message'] or ''}")


@app.command()
def logs(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Stream the log with a progress bar until the job ends.")
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """The job's log (from Ray). With -f: follow it, with iteration / loss / tokens/s / ETA, without
    Ray's own lines (--verbose: with them; all of it goes to ELASTRON_HOME/logs/<job id>.log)."""
    client = _client()
    if not follow:
        typer.echo(_api(client.logs, job_id), nl=False)
        return
    final = _follow(client, job_id, verbose)
    raise typer.Exit(0 if final["state"] == "succeeded" else 1)


@app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    wait: Annotated[bool, typer.Option(help="Wait until the job has stopped.")] = False,
) -> None:
    """Cancel a job: queued jobs at once, running ones with a graceful stop."""
    client = _client()
    job = _api(client.cancel, job_id)
    while wait and job["state"] not in FINAL:
        time.sleep(1.0)
        job = _api(client.job, job_id)
    typer.echo(f"{job_id}: {job['state']}" + ("" if job["state"] in FINAL else " (stop requested)"))


@app.command()
def demo(
    job: Annotated[Path, typer.Option(help="The job file to run.")] = DEMO_JOB,
    verbose: VerboseOption = False,
) -> None:
    """`up`, submit a small Llama-style job (TP=2 on 2 CPU ranks), follow it, print a summary."""
    up()
    spec = _read_job_file(job)
    client = _client()
    created = _api(client.submit, spec)
    typer.echo(f"submitted {job} as {created['id']}")
    final = _follow(client, created["id"], verbose)
    records = _api(client.all_metrics, created["id"])
    from service.cli_follow import summary

    summary(client, final, records)
    raise typer.Exit(0 if final["state"] == "succeeded" else 1)
