"""Checkpoint evaluations as Ray work, one pass of the reconcile loop (service/reconciler.py,
step 7): the recorded evaluations submitted as `elastron eval` Ray jobs of their own (a CPU per
rank asked for), their ends recorded with the scores their last `eval-result` line reported and
the job's `eval_succeeded` / `eval_failed` event (the pass itself: service/command_runs.py). A
run that succeeded without a readable result is failed, naming that.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.command_runs import CommandRuns
from service.evals import eval_command, scores_from_log
from service.launcher import export_resources
from service.storage_policy import eval_env
from service.store.evals import FAILED, SUCCEEDED, finish_eval
from service.store.models import Evaluation, Job


class EvalRuns(CommandRuns):
    model = Evaluation
    what = "evaluation"
    success_prefix = "evaluated iteration"

    def launch(self, session: Session, row: Evaluation, job: Job):
        argv = eval_command(
            self.settings,
            source=row.source,
            tasks=row.tasks,
            options=row.options,
            endpoint_url=(job.spec.get("checkpoint") or {}).get("endpoint_url"),
            run=job.id,
        )
        ranks = int(row.options.get("ranks", 1))
        cpus = max(self.settings.export_num_cpus, 1.0) * ranks  # each rank a process of its own
        return argv, eval_env(self.settings, session, job.id, job.tenant), export_resources(
            cpus, self.settings.export_memory_gib
        )

    def finish(self, session: Session, row: Evaluation, status: str, message: str | None, log_text: str) -> None:
        scores = scores_from_log(log_text) if status == SUCCEEDED else None
        if status == SUCCEEDED and not scores:
            status, message = FAILED, f"{row.submission_id} ended without an eval-result line in its log ({message})"
        finish_eval(session, row, status, message, scores)
