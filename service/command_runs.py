"""Rows of the store run as commands of their own on the launcher (a Ray job each): exports and
evaluations. One pass of the reconcile loop submits the recorded rows (`submitted_at` null), then
polls the submitted unfinished ones and records how they ended, with the command's own verdict
from its log. Done in the loop rather than on read, so that no request waits on Ray and a run's
end is recorded whether or not anyone asks. A subclass says which rows, how each is launched and
how its end is recorded (service/export_runs.py, service/eval_runs.py).
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.launcher import EntrypointResources, LauncherUnavailable, LaunchStatus
from service.reconcile.step import ReconcileStep
from service.store.db import in_transaction
from service.store.exports import FAILED, RUNNING, SUCCEEDED, UNFINISHED
from service.store.jobs import get_job
from service.store.models import Job

log = logging.getLogger(__name__)
MAX_MESSAGE_CHARS = 4000


class CommandRuns(ReconcileStep):
    model: Any  # the row class: id, job_id, status, submission_id, submitted_at, created_at
    what = "command"  # in log lines
    success_prefix = ""  # the command's log line that says what it did, on success

    # ----------------------------------------------------------------- what a subclass says
    def launch(self, session: Session, row, job: Job) -> tuple[list[str], dict[str, str], EntrypointResources]:
        """(argv, environment, entrypoint resources) of `row`'s command."""
        raise NotImplementedError

    def finish(self, session: Session, row, status: str, message: str | None, log_text: str) -> None:
        """Record the end of `row` (status SUCCEEDED or FAILED) and its job event."""
        raise NotImplementedError

    # ----------------------------------------------------------------- the pass
    def run_pass(self) -> None:
        model = self.model
        with self.sessions() as s:
            rows = s.execute(
                select(model.id, model.submission_id, model.submitted_at, model.status)
                .where(model.status.in_(UNFINISHED))
                .order_by(model.created_at)
            ).all()
        fresh = [row_id for row_id, _, submitted_at, _ in rows if submitted_at is None]
        for row_id in fresh[: self.settings.dispatch_batch]:
            if self._stopping.is_set():
                return
            self._submit(row_id)
        submitted = {sid: (row_id, status) for row_id, sid, at, status in rows if at is not None}
        if not submitted:
            return
        found = self.launcher.statuses(submitted)
        for sid, (row_id, status) in submitted.items():
            seen = found.get(sid, LaunchStatus.MISSING)
            if seen == LaunchStatus.PENDING or (seen == LaunchStatus.RUNNING and status == RUNNING):
                continue  # nothing new: no transaction
            message, text = (None, "") if seen == LaunchStatus.RUNNING else self._ended(sid, seen)
            try:
                in_transaction(
                    self.sessions, lambda s, r=row_id, st=seen, m=message, t=text: self._apply(s, r, st, m, t)
                )
            except Exception:
                log.exception("%s %s: could not apply launcher status %s", self.what, row_id, seen)

    def _submit(self, row_id: str) -> None:
        with self.sessions() as s:
            row = s.get(self.model, row_id)
            job = get_job(s, row.job_id) if row is not None else None
            if row is None or job is None or row.submitted_at is not None:
                return
            argv, env, resources = self.launch(s, row, job)
            sid = row.submission_id
        try:
            self.launcher.submit_command(sid, argv, env, resources=resources)  # idempotent per sid
        except LauncherUnavailable:
            raise  # the pass stops; the next one submits it again
        except Exception as err:
            log.exception("%s %s: submitting %s failed", self.what, row_id, sid)

            def refused(s: Session, e: Exception = err) -> None:
                row = s.get(self.model, row_id)
                if row is not None:
                    self.finish(s, row, FAILED, f"{self.launcher.describe()} refused {sid}: {e}", "")

            in_transaction(self.sessions, refused)
            return

        def submitted(s: Session) -> None:
            row = s.get(self.model, row_id)
            if row is not None and row.submitted_at is None:
                row.submitted_at = self.clock()

        in_transaction(self.sessions, submitted)

    def _ended(self, sid: str, status: LaunchStatus) -> tuple[str | None, str]:
        """(message, the command's log) of a run that ended: the launcher's message with the
        command's own verdict, its `error: ...` line on a failure, its `success_prefix` line on
        a success."""
        if status == LaunchStatus.MISSING:
            return f"{sid} vanished from {self.launcher.describe()} (the cluster restarted or its record was deleted)", ""
        try:
            message = self.launcher.message(sid)
            text = self.launcher.logs(sid) or ""
        except LauncherUnavailable:
            message, text = None, ""
        prefix = self.success_prefix if status == LaunchStatus.SUCCEEDED else "error:"
        lines = [line.strip() for line in text.splitlines() if line.strip().startswith(prefix)]
        if status == LaunchStatus.SUCCEEDED:
            return (lines[-1][:MAX_MESSAGE_CHARS] if lines else message), text
        parts = [
            p
            for p in (
                f"{sid} was stopped" if status == LaunchStatus.STOPPED else None,
                lines[-1] if lines else None,
                message,
            )
            if p
        ]
        joined = "; ".join(parts) or f"{sid} failed without a message"
        half = MAX_MESSAGE_CHARS // 2
        return (joined if len(joined) <= MAX_MESSAGE_CHARS else joined[:half] + "\n...\n" + joined[-half:]), text

    def _apply(self, s: Session, row_id: str, status: LaunchStatus, message: str | None, text: str) -> None:
        row = s.get(self.model, row_id)
        if row is None or row.status not in UNFINISHED:
            return
        if status == LaunchStatus.RUNNING:
            row.status = RUNNING
        elif status == LaunchStatus.SUCCEEDED:
            self.finish(s, row, SUCCEEDED, message, text)
        else:  # failed, stopped, missing
            self.finish(s, row, FAILED, message, text)
