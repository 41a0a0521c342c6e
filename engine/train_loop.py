"""The per-rank training loop: build a Trainer, step it to `training.train_iters`, save and
snapshot when due, and hand rank 0's record of every step to whoever listens. Launchers (the
local `elastron train`, Ray workers) call `train_rank` with the rank's identity and hooks
(engine/rank_hooks.py); what one step does is the Trainer's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from engine import parallel_state as ps
from engine.jobspec import JobSpec, ResolvedJob, resolve_job
from engine.loggers import open_loggers
from engine.loggers import require as require_loggers
from engine.rank_hooks import RankHooks, RankIdentity
from engine.step_metrics import progress_line
from engine.training import Trainer


def train_rank(
    job: ResolvedJob | JobSpec | dict[str, Any],
    metrics_out: str | None = None,
    quiet: bool = False,
    events_out: str | None = None,
    on_record: Callable[[dict], None] | None = None,
    *,
    hooks: RankHooks | None = None,
    identity: RankIdentity | None = None,
    on_trainer: Callable[[Trainer], None] | None = None,
    on_snapshot_due: Callable[[Trainer], None] | None = None,
) -> list[dict]:
    """Per-rank entry point: train the whole job; rank 0 writes and returns the metrics records.

    `job` is resolved once by the launcher (a ResolvedJob); a spec or its JSON is resolved here.

    `identity` says who runs this rank (engine/rank_hooks.py; default: this host, or
    `ELASTRON_NODE_ID`); `hooks` what the launcher hears (`RankHooks`: on_trainer, on_record,
    on_snapshot_due, on_event). The loose `on_record`, `on_trainer` and `on_snapshot_due`
    arguments are the same hooks for callers that need only one; a hook given both ways is an
    error. Every rank appends its events (rerun state machine, checkpointer) to `events_out`
    when given (`elastron train`'s event record) and hands each to `hooks.on_event` in-process.
    A rerun verdict that stops the job raises RerunExit on every rank, carrying exit code 16
    or 17.

    `on_trainer` gets every rank's Trainer, from the training thread, once it is built (and
    resumed) and before the first step, because a launcher's watchdog and shutdown hook must
    read its progress (`iteration`, `phase`) and its checkpointer from their own threads. It is
    called after construction, never with a half-built Trainer, so that no caller depends on
    the order in which `Trainer.__init__` sets attributes. Setup (model build, data, resume) can
    hang too; a caller that watches for that watches its own stand-in in phase "setup" until
    on_trainer replaces it (workers/rank.py does), which costs the engine no second hook.

    `on_snapshot_due` is called on every rank after the iterations checkpoint.local_interval
    names (`Trainer.snapshot_due`): the caller takes an in-memory snapshot
    (`Trainer.capture_snapshot`) and keeps it where a restarted rank finds it; the engine keeps
    none itself (a snapshot that dies with the process is no use)."""
    hooks = _merge_hooks(hooks, on_record=on_record, on_trainer=on_trainer, on_snapshot_due=on_snapshot_due)
    identity = identity or RankIdentity.local()
    _check_identity(identity)
    job = job if isinstance(job, ResolvedJob) else resolve_job(job)
    return _train(job, metrics_out, quiet, events_out, hooks, identity)


def _merge_hooks(hooks: RankHooks | None, **loose: Callable | None) -> RankHooks:
    merged = replace(hooks) if hooks is not None else RankHooks()
    for name, fn in loose.items():
        if fn is None:
            continue
        if getattr(merged, name) is not None:
            raise TypeError(f"train_rank: {name} given both in hooks and as an argument")
        setattr(merged, name, fn)
    return merged


def _check_identity(identity: RankIdentity) -> None:
    """A launcher that names the rank and world size must name the process group's."""
    said, actual = (identity.rank, identity.world_size), (dist.get_rank(), dist.get_world_size())
    if any(s is not None and s != a for s, a in zip(said, actual, strict=True)):
        raise ValueError(
            f"train_rank: the launcher says rank {said[0]} of {said[1]}, the process group "
            f"{actual[0]} of {actual[1]}"
        )


def _train(
    job: ResolvedJob,
    metrics_out: str | None,
    quiet: bool,
    events_out: str | None,
    hooks: RankHooks,
    identity: RankIdentity,
) -> list[dict]:
    require_loggers(job.spec.training.loggers)
    trainer = Trainer(job, events_path=events_out, identity=identity, on_event=hooks.on_event, quorum=hooks.quorum)
    spec = trainer.spec
    is_logger = dist.get_rank() == 0
    records: list[dict] = []
    sink = None
    if is_logger and metrics_out:
        Path(metrics_out).parent.mkdir(parents=True, exist_ok=True)
        # A resumed job appends to the metrics it already wrote.
        sink = open(metrics_out, "a" if trainer.iteration else "w")  # noqa: SIM115 - closed below
    loggers = None
    try:
        # TensorBoard / MLflow / W&B (training.loggers): rank 0 writes, like the records; with
        # replicas as fault domains, replica 0's (each is a rank 0 of its own group, and two
        # writers of one run would duplicate or clash: the steps replica 0 misses while it is
        # replaced are in the job's records, not in these).
        if is_logger and trainer.replica_sync.writes_logs:
            loggers = open_loggers(spec.model_dump(mode="json"), identity.job_id)
        if hooks.on_trainer is not None:
            hooks.on_trainer(trainer)
        if is_logger and not quiet:
            c, g = trainer.config, ps.get_grid()
            n_params = sum(p.numel() for chunk in trainer.model_chunks for p in chunk.parameters())
            print(
                f"[elastron] {spec.name}: {spec.model.arch} {c.num_layers}L h{c.hidden_size} on "
                f"{g.world_size} ranks (tp={g.tp} pp={g.pp} cp={g.cp} dp={g.dp}), "
                f"{n_params:,} params per rank, {spec.training.precision}",
                flush=True,
            )
        if is_logger and not quiet and trainer.hf_import is not None:
            r = trainer.hf_import
            print(
                f"[elastron] imported {spec.model.init_from}: {r.tensors} tensors, {r.bytes_read:,} of "
                f"{r.file_bytes:,} bytes read by rank 0, {r.seconds:.2f} s",
                flush=True,
            )
        if is_logger and not quiet and trainer.iteration:
            print(f"[elastron] resumed at iteration {trainer.iteration}", flush=True)
        saved_at = trainer.iteration  # a fresh start or the checkpoint it resumed from
        out = _RecordOut(records, hooks, sink, loggers, quiet, spec.training) if is_logger else None
        if out is not None and trainer.checkpointer is not None:
            # A synchronous save hands the step's record on once its checkpoint is committed,
            # before the save's closing collective, which a frozen peer can hold up for as long
            # as it is frozen (and a watchdog kill then loses whatever had not gone out).
            trainer.checkpointer.on_commit = out.committed
        while trainer.iteration < spec.training.train_iters:
            if hooks.should_stop is not None and trainer.replica_sync.stop_agreed(hooks.should_stop()):
                _save_and_stop(trainer, saved_at, quiet=quiet or not is_logger)
                break
            if hooks.should_leave is not None and trainer.replica_sync.leave_agreed(hooks.should_leave()):
                break  # released: the other replicas hold the state and go on
            m = trainer.train_step()
            if m is None:  # the rerun state machine skipped a bad batch (or no quorum step)
                if trainer.replica_sync.job_done:
                    break  # a replacement that joined after its peers finished the job
                continue
            trainer.evaluate_if_due(m)
            if out is not None:
                out.pending = m
            try:
                # A save can commit on rank 0 and then fail in its closing collective (a peer died
                # or froze after the shard gather): the record goes out at the commit (on_commit)
                # or, at the latest, below; a resume from that commit never runs this step again.
                if trainer.save_checkpoint_if_due():
                    saved_at = trainer.iteration
                # Before the record: when the record says a step is done, its snapshot is taken
                # and only its push can be in flight (a failure re-runs at most that step).
                if hooks.on_snapshot_due is not None and trainer.snapshot_due():
                    trainer.phase = "checkpoint-local"
                    hooks.on_snapshot_due(trainer)
            finally:
                # Even when the save or the snapshot fails (collectives: a peer died), the record
                # goes out: a resume from the persistent checkpoint just committed never runs the
                # step again.
                if out is not None:
                    out.send()
        if trainer.checkpointer is not None:
            trainer.checkpointer.wait()  # the last save is committed before the job reports done
    finally:
        if sink:
            sink.close()
        if loggers is not None:
            loggers.close()
        trainer.replica_sync.shutdown()
        ps.destroy_model_parallel()
    return records


class _RecordOut:
    """Rank 0's records: each step's record handed on exactly once, at the end of its step or,
    when its synchronous save commits, at the commit (`committed`)."""

    def __init__(self, records: list[dict], hooks: RankHooks, sink, loggers, quiet: bool, training) -> None:
        self.records, self.hooks, self.sink, self.loggers = records, hooks, sink, loggers
        self.quiet, self.training = quiet, training
        self.pending = None  # the StepMetrics of the step in progress, until it is handed on

    def committed(self, iteration: int) -> None:
        if self.pending is not None and self.pending.iteration == iteration:
            self.send()

    def send(self) -> None:
        m, self.pending = self.pending, None
        if m is None:
            return
        rec = asdict(m)
        self.records.append(rec)
        if self.hooks.on_record is not None:
            self.hooks.on_record(rec)
        if self.sink:
            self.sink.write(json.dumps(rec) + "\n")
            self.sink.flush()
        if self.loggers is not None:  # TensorBoard / MLflow / W&B (training.loggers)
            self.loggers.log(rec)
        if not self.quiet and (m.iteration % self.training.log_interval == 0 or m.valid_loss is not None):
            print(progress_line(m, self.training.train_iters), flush=True)


def _save_and_stop(trainer: Trainer, saved_at: int, quiet: bool) -> None:
    """Stop asked for (a preemption): a persistent checkpoint of the current step, unless the
    last step saved one already, committed before the loop returns; then the job resumes from
    here with nothing lost."""
    checkpointed = (
        trainer.checkpointer is not None
        and trainer.spec.checkpoint.path is not None
        and trainer.replica_sync.writes_checkpoint
    )
    if checkpointed and saved_at != trainer.iteration:
        trainer.phase = "checkpoint-save"
        trainer.checkpointer.save()
    trainer.events.append("stopped_on_request", iteration=trainer.iteration, checkpointed=checkpointed)
    if not quiet:
        print(
            f"[elastron] stopping at iteration {trainer.iteration} as asked"
            + (" (checkpoint saved)" if checkpointed else " (no checkpoint.path: nothing saved)"),
            flush=True,
        )
