"""`elastron`: one command line over the three layers, each of which owns its commands.

engine/cli.py: train, export, eval, schema, preprocess, checkpoint convert; workers/cli.py: worker-run;
service/cli.py: up, down, token (create, list, revoke), submit, jobs (and jobs export), status,
logs, cancel, demo, queue, tenants (set-quota, quota, set-storage, storage), sweep (submit,
status, list, extend, cancel). This module only puts
them together; it sits above the layers (the one place allowed to import all three), so that the
service imports nothing of the engine but the job spec, and nothing of the workers. No torch or
Ray at import: each command imports what it needs when it runs.
"""

from __future__ import annotations

import typer

from engine.cli import app as engine_commands
from service.cli import app as service_commands
from workers.cli import app as worker_commands

app = typer.Typer(no_args_is_help=True, add_completion=False, help="elastron: train large transformers.")
# Order of registration is the order `elastron --help` lists them in (as before the split).
app.add_typer(engine_commands)  # train, export, eval, schema, preprocess, checkpoint
app.add_typer(worker_commands)  # worker-run
app.add_typer(service_commands)  # up, down, submit, status, logs, cancel, demo, queue, token, jobs, tenants, sweep


def main() -> None:
    app()


if __name__ == "__main__":
    main()
