"""`elastron tenants set-storage TENANT --root R [--root R2 ...] [--read-root R ...]` and
`elastron tenants storage TENANT`: the storage roots a tenant's jobs and exports may use beyond
its defaults (service/storage_policy.py). Setting them needs an admin token.
"""

from __future__ import annotations

from typing import Annotated

import typer

from service.cli_jobs import _api, _client
from service.cli_queue import tenants_app


def _show(s: dict) -> None:
    typer.echo(f"tenant {s['tenant']}:")
    typer.echo(f"  default (read-write): {', '.join(s['default_roots'])}")
    typer.echo(f"  granted read-write:   {', '.join(s['roots']) or '-'}")
    typer.echo(f"  granted read-only:    {', '.join(s['read_roots']) or '-'}")
    typer.echo(f"  shared read-only:     {', '.join(s['shared_read_roots']) or '-'}")


@tenants_app.command("set-storage")
def set_storage(
    tenant: Annotated[str, typer.Argument(help="The tenant.")],
    root: Annotated[
        list[str] | None,
        typer.Option(
            "--root", help="A root its jobs may read and write (absolute path or s3://bucket/prefix)."
        ),
    ] = None,
    read_root: Annotated[
        list[str] | None, typer.Option("--read-root", help="A root its jobs may only read.")
    ] = None,
) -> None:
    """Grant TENANT storage roots (the whole list: roots left out are revoked; none: defaults only)."""
    client = _client()
    body = {"roots": root or [], "read_roots": read_root or []}
    _show(_api(lambda: client._call("PUT", f"/v1/tenants/{tenant}/storage", json=body).json()))


@tenants_app.command("storage")
def storage(tenant: Annotated[str, typer.Argument(help="The tenant.")]) -> None:
    """Show the storage roots TENANT's jobs and exports may use."""
    client = _client()
    _show(_api(lambda: client._call("GET", f"/v1/tenants/{tenant}/storage").json()))
