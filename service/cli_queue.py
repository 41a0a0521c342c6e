"""The scheduler's commands: `elastron queue` (waiting jobs in order, with why each waits, and the
cluster's use) and `elastron tenants set-quota` / `tenants quota` (a tenant's limits; setting
them needs an admin token). Thin HTTP clients like the job commands (service/cli_jobs.py).
"""

from __future__ import annotations

from typing import Annotated

import typer

from service.cli_jobs import _api, _client, app

tenants_app = typer.Typer(help="Tenants' quotas (set with an admin token).", no_args_is_help=True)
app.add_typer(tenants_app, name="tenants")


def _limit(value: float | int | None) -> str:
    return "unlimited" if value is None else f"{value:g}"


def _show_quota(q: dict) -> None:
    typer.echo(
        f"tenant {q['tenant']}: ranks {_limit(q['ranks'])}, GPUs {_limit(q['gpus'])}, CPUs {_limit(q['cpus'])}, "
        f"queued jobs {_limit(q['queued'])}, max priority {_limit(q['max_priority'])}, "
        f"non-preemptible jobs {'allowed' if q['allow_non_preemptible'] else 'not allowed'}"
    )


@tenants_app.command("set-quota")
def set_quota(
    tenant: Annotated[str, typer.Argument(help="The tenant.")],
    gpus: Annotated[float | None, typer.Option(help="GPUs its jobs may hold at once.")] = None,
    cpus: Annotated[float | None, typer.Option(help="CPUs its jobs may hold at once.")] = None,
    ranks: Annotated[int | None, typer.Option(help="Ranks its jobs may run at once.")] = None,
    queued: Annotated[int | None, typer.Option(help="Jobs it may have waiting (more are refused).")] = None,
    max_priority: Annotated[int | None, typer.Option(help="The highest scheduling.priority it may use.")] = None,
    allow_non_preemptible: Annotated[
        bool, typer.Option(help="Let its jobs set scheduling.preemptible: false.")
    ] = False,
) -> None:
    """Set TENANT's quota (the whole of it: an option left out is unlimited)."""
    client = _client()
    body = {
        "gpus": gpus,
        "cpus": cpus,
        "ranks": ranks,
        "queued": queued,
        "max_priority": max_priority,
        "allow_non_preemptible": allow_non_preemptible,
    }
    _show_quota(_api(client.set_quota, tenant, body))


@tenants_app.command("quota")
def quota(tenant: Annotated[str, typer.Argument(help="The tenant.")]) -> None:
    """Show TENANT's quota."""
    client = _client()
    _show_quota(_api(client.quota, tenant))


@app.command("queue")
def queue() -> None:
    """Waiting jobs in the order they will start, with why each waits (an admin token: everyone's)."""
    client = _client()
    page = _api(client.queue)
    cluster = page["cluster"]
    if cluster:
        typer.echo(
            f"cluster: {cluster['nodes']} nodes, CPUs {cluster['allocated_cpus']:g}/{cluster['cpus']:g} "
            f"allocated, GPUs {cluster['allocated_gpus']:g}/{cluster['gpus']:g} allocated"
        )
    else:
        typer.echo("cluster: capacity unknown (jobs are handed to Ray in submission order)")
    if not page["jobs"]:
        typer.echo("no jobs waiting")
        return
    typer.echo(f"{'POS':>4}  {'ID':<40} {'TENANT':<12} {'PRIO':>5} {'RANKS':>5} {'WAITED':>8}  REASON")
    for j in page["jobs"]:
        pos = "-" if j["position"] is None else str(j["position"])
        waited = f"{j['waited_s']:.0f}s"
        typer.echo(
            f"{pos:>4}  {j['id']:<40} {j['tenant']:<12} {j['priority']:>5} {j['ranks'] or '-':>5} {waited:>8}  "
            f"{j['waiting_reason'] or ''}"
        )
