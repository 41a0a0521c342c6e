"""Checkpoint exports as Ray work, one pass of the reconcile loop (service/reconciler.py, step 6):
submit the recorded exports (`elastron export` as their own Ray job, with entrypoint resources:
it loads the whole model, so never on the head by default), then poll the submitted unfinished
ones and record how they ended (status, message, and the job's `export_succeeded` /
`export_failed` event). Done in the loop rather than on read so that no request waits on Ray and
an export's end is recorded whether or not anyone asks. Its own module: the reconciler's other
steps never touch exports.
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.exports import export_command
from service.launcher import LauncherUnavailable, LaunchStatus, export_resources
from service.reconcile.step import ReconcileStep
from service.storage_policy import export_env
from service.store.db import in_transaction
from service.store.exports import FAILED, RUNNING, SUCCEEDED, UNFINISHED, finish_export
from service.store.jobs import get_job
from service.store.models import Export

log = logging.getLogger(__name__)


class ExportRuns(ReconcileStep):
    def run_pass(self) -> None:
        with self.sessions() as s:
            rows = s.execute(
                select(Export.id, Export.submission_id, Export.submitted_at, Export.status)
                .where(Export.status.in_(UNFINISHED))
                .order_by(Export.created_at)
            ).all()
        fresh = [export_id for export_id, _, submitted_at, _ in rows if submitted_at is None]
        for export_id in fresh[: self.settings.dispatch_batch]:
            if self._stopping.is_set():
                return
            self._submit_export(export_id)
        submitted = {sid: (export_id, status) for export_id, sid, at, status in rows if at is not None}
        if not submitted:
            return
        found = self.launcher.statuses(submitted)
        for sid, (export_id, status) in submitted.items():
            seen = found.get(sid, LaunchStatus.MISSING)
            if seen == LaunchStatus.PENDING or (seen == LaunchStatus.RUNNING and status == RUNNING):
                continue  # nothing new: no transaction
            message = None if seen == LaunchStatus.RUNNING else self._export_message(sid, seen)
            try:
                in_transaction(
                    self.sessions, lambda s, e=export_id, st=seen, m=message: self._apply_export(s, e, st, m)
                )
            except Exception:
                log.exception("export %s: could not apply launcher status %s", export_id, seen)

    def _submit_export(self, export_id: str) -> None:
        with self.sessions() as s:
            export = s.get(Export, export_id)
            job = get_job(s, export.job_id) if export is not None else None
            if export is None or job is None or export.submitted_at is not None:
                return
            argv = export_command(
                self.settings,
                source=export.source,
                output=export.output,
                format=export.format,
                dtype=export.dtype,
                endpoint_url=(job.spec.get("checkpoint") or {}).get("endpoint_url"),
            )
            sid = export.submission_id
            env = export_env(self.settings, s, job.id, job.tenant, export.output)
        try:
            # Idempotent per sid: a retry is safe. It loads the whole model: never on the head.
            resources = export_resources(self.settings.export_num_cpus, self.settings.export_memory_gib)
            self.launcher.submit_command(sid, argv, env, resources=resources)
        except LauncherUnavailable:
            raise  # the pass stops; the next one submits it again
        except Exception as err:
            log.exception("export %s: submitting %s failed", export_id, sid)

            def refused(s: Session, e: Exception = err) -> None:
                row = s.get(Export, export_id)
                if row is not None:
                    finish_export(s, row, FAILED, f"{self.launcher.describe()} refused {sid}: {e}")

            in_transaction(self.sessions, refused)
            return

        def submitted(s: Session) -> None:
            row = s.get(Export, export_id)
            if row is not None and row.submitted_at is None:
                row.submitted_at = self.clock()

        in_transaction(self.sessions, submitted)

    def _export_message(self, sid: str, status: LaunchStatus) -> str | None:
        """The launcher's message, with the command's own verdict from its log: the `error: ...`
        line of a failure, the `exported iteration ...` line of a success."""
        if status == LaunchStatus.MISSING:
            return f"{sid} vanished from {self.launcher.describe()} (the cluster restarted or its record was deleted)"
        try:
            message = self.launcher.message(sid)
            text = self.launcher.logs(sid) or ""
        except LauncherUnavailable:
            message, text = None, ""
        prefix = "exported iteration" if status == LaunchStatus.SUCCEEDED else "error:"
        lines = [line.strip() for line in text.splitlines() if line.strip().startswith(prefix)]
        if status == LaunchStatus.SUCCEEDED:
            return lines[-1][:4000] if lines else message
        parts = [
            p
            for p in (
                f"{sid} was stopped" if status == LaunchStatus.STOPPED else None,
                lines[-1] if lines else None,
                message,
            )
            if p
        ]
        text = "; ".join(parts) or f"{sid} failed without a message"
        return text if len(text) <= 4000 else text[:2000] + "\n...\n" + text[-2000:]

    def _apply_export(self, s: Session, export_id: str, status: LaunchStatus, message: str | None) -> None:
        export = s.get(Export, export_id)
        if export is None or export.status not in UNFINISHED:
            return
        if status == LaunchStatus.RUNNING:
            export.status = RUNNING
        elif status == LaunchStatus.SUCCEEDED:
            finish_export(s, export, SUCCEEDED, message)
        else:  # failed, stopped, missing
            finish_export(s, export, FAILED, message)
