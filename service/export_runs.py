"""Checkpoint exports as Ray work, one pass of the reconcile loop (service/reconciler.py, step 6):
the recorded exports submitted as `elastron export` Ray jobs of their own (with entrypoint
resources: it loads the whole model, so never on the head by default), their ends recorded with
the job's `export_succeeded` / `export_failed` event (the pass itself: service/command_runs.py).
Its own module: the reconciler's other steps never touch exports.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.command_runs import CommandRuns
from service.exports import export_command
from service.launcher import export_resources
from service.storage_policy import export_env
from service.store.exports import finish_export
from service.store.models import Export, Job


class ExportRuns(CommandRuns):
    model = Export
    what = "export"
    success_prefix = "exported iteration"

    def launch(self, session: Session, row: Export, job: Job):
        argv = export_command(
            self.settings,
            source=row.source,
            output=row.output,
            format=row.format,
            dtype=row.dtype,
            endpoint_url=(job.spec.get("checkpoint") or {}).get("endpoint_url"),
        )
        env = export_env(self.settings, session, job.id, job.tenant, row.output)
        return argv, env, export_resources(self.settings.export_num_cpus, self.settings.export_memory_gib)

    def finish(self, session: Session, row: Export, status: str, message: str | None, log_text: str) -> None:
        finish_export(session, row, status, message)
