"""Apply one telemetry batch (service/METRICS.md's wire format) to a job, in one transaction.

Delivery is at least once, so everything here is idempotent:
- a record whose iteration is already stored is ignored, unless the stored one comes from an
  earlier worker group of the job (its `group`, else `attempt`, else the restarts reported
  before it, is lower): then the job resumed from an earlier checkpoint (a restart or an
  elastic resize) and redid that iteration, and the newer record replaces it;
- an event is stored once, keyed by its `id` field when the sender gives one, else by a hash
  of its content (the engine's events carry a timestamp, rank and host, so two real events
  never hash alike).
Events are applied before records: a batch holding a restart and the records after it counts
those records in the new epoch.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from engine.jobspec import contract
from service import progress, stragglers
from service.states import FINAL, JobState
from service.store import stats as job_stats
from service.store.evals import evaluations_on_checkpoint
from service.store.jobs import add_event, transition
from service.store.models import Checkpoint, Job, JobEvent, JobMetric

# METRICS.md: the workers' driver reports a worker-group restart as `restart` with `cause`.
RESTART_KIND = contract.EVENT_RESTART


@dataclass
class IngestResult:
    records_accepted: int = 0
    records_replaced: int = 0
    records_ignored: int = 0
    events_accepted: int = 0
    events_duplicate: int = 0


def finite(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities become null (Postgres json and strict JSON refuse them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def number(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (bools, NaN, text)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def event_key(event: dict[str, Any]) -> str:
    if isinstance(event.get("id"), str | int):
        return hashlib.sha256(f"id:{event['id']}".encode()).hexdigest()
    return hashlib.sha256(json.dumps(event, sort_keys=True, default=str).encode()).hexdigest()


def ingest(
    session: Session, job: Job, records: list[dict[str, Any]], events: list[dict[str, Any]]
) -> IngestResult:
    result = IngestResult()
    stats = job_stats.editable(job.stats)
    _apply_events(session, job, [finite(e) for e in events], stats, result)
    _apply_records(session, job, [finite(r) for r in records], stats, result)
    job.stats = stats
    job.updated_at = time.time()
    return result


def _event_message(kind: str, event: dict[str, Any]) -> str | None:
    if kind == RESTART_KIND:
        return f"worker group restart: {event.get('cause') or event.get('reason') or 'unknown cause'}"
    if kind == "diagnosis":
        return f"rerun state machine diagnosis: {event.get('diagnosis')}"
    if kind == "checkpoint_saved":
        return f"checkpoint saved: {event.get('uri')}"
    if kind == "checkpoint_failed":
        return f"checkpoint save failed: {event.get('error') or event.get('message') or 'no detail'}"
    text = event.get("message")
    return text if isinstance(text, str) else None


def _apply_events(session: Session, job: Job, events: list[dict], stats: dict, result: IngestResult) -> None:
    if not events:
        return
    keyed = [(event_key(e), e) for e in events]
    known = set(
        session.scalars(
            select(JobEvent.dedup_key).where(
                JobEvent.job_id == job.id, JobEvent.dedup_key.in_({k for k, _ in keyed})
            )
        )
    )
    for key, event in keyed:
        if key in known:
            result.events_duplicate += 1
            continue
        known.add(key)
        result.events_accepted += 1
        kind = str(event["kind"])
        iteration = event.get("iteration") if isinstance(event.get("iteration"), int) else None
        ts = number(event.get("ts"))
        add_event(
            session,
            job,
            kind,
            _event_message(kind, event),
            iteration=iteration,
            data=event,
            ts=ts,
            dedup_key=key,
        )
        if kind == RESTART_KIND:
            cause = str(event.get(contract.EVENT_CAUSE) or "unknown")[:64]
            job.restarts += 1
            job_stats.count(stats, "restarts", cause)
            if job.state not in FINAL:
                transition(session, job, JobState.RESTARTING, f"worker group restart: {cause}", stats=stats)
        elif kind == contract.EVENT_RECOVERED:
            source = str(event.get(contract.RECOVERED_FROM) or "unknown")[:16]
            job_stats.count(stats, "recoveries", source)
            lost = number(event.get(contract.STEPS_LOST))
            if lost is not None and lost >= 0:
                job_stats.add(stats, "steps_lost", lost)
            phases = event.get(contract.RECOVERY_PHASES)
            if isinstance(phases, dict):  # the last recovery's phases (a gauge per phase)
                stats["recovery_s"] = {str(k)[:32]: v for k, v in phases.items() if number(v) is not None}
        elif kind == contract.EVENT_REPLICA_LOST:  # replace_replica: the survivors stepped without one
            job_stats.add(stats, "replicas_lost", 1)
            if number(event.get("stall_s")) is not None:
                stats["survivor_stall_s"] = number(event["stall_s"])
        elif kind == contract.EVENT_REPLICA_REJOINED and "heal_s" not in event:
            job_stats.add(stats, "replicas_rejoined", 1)  # the survivors' side of the rejoin only
            if number(event.get("rejoin_s")) is not None:  # None: back before it was missed
                stats["rejoin_s"] = number(event["rejoin_s"])
        elif kind == "diagnosis" and event.get("diagnosis"):
            job_stats.count(stats, "reruns", str(event["diagnosis"]))
        elif kind in ("checkpoint_saved", "checkpoint_failed"):
            _apply_checkpoint(session, job, kind, event, iteration, ts, stats)
        elif kind == contract.EVENT_RANKS_STARTED and job.state not in FINAL:
            placed = ranks_per_node(event.get(contract.RANKS))
            if placed:  # the scheduler counts where Ray put the ranks, not where it meant them to go
                job.placement = placed
        elif kind == contract.EVENT_REPLICA_STARTED and job.state not in FINAL:
            _place_replica(job, event, stats)
        elif kind == contract.EVENT_RESIZED and event.get("live") and job.state not in FINAL:
            live_resized(job, event)


def live_group(job: Job) -> int:
    """The ranks of one replica group of a job resized live (resilience.resize: live, from its
    stored demand: service/scheduling/demand.py), or 0 for a job resized by a stop and relaunch."""
    return int((job.demand or {}).get("live_group") or 0)


def live_target(job: Job) -> int | None:
    """The replica groups a live-resized job is asked to run (TelemetryAck.replicas), or None when
    no live resize is in flight (a restart-based one sets a preemption beside resize_to; a
    preemption asked during a live one cleared it: service/reconcile/preemption.py)."""
    group = live_group(job)
    if not group or job.resize_to is None or job.preempt_requested_at is not None or job.submission_id is None:
        return None
    return job.resize_to // group


def live_resized(job: Job, event: dict) -> None:
    """The driver's `resized` (live): the resize is over; the scheduler counts where the job's
    ranks now run (the event's `ranks`, else the placement it was resized to)."""
    placed = ranks_per_node(event.get(contract.RANKS))
    job.placement = placed or dict(job.resize_placement or {}) or job.placement
    job.resize_to = job.resize_placement = None


def _place_replica(job: Job, event: dict, stats: dict) -> None:
    """replace_replica: each rank (a replica's, or a replacement's) reports its own start, with
    no ranks_started for the group. The newest node of every rank is kept in the job's stats;
    once each of the group's ranks has reported, the placement the scheduler counts is theirs
    (a replacement Ray put on another node moves its rank there)."""
    world = event.get("world_size", event.get("replicas"))
    ranks = event.get(contract.RANKS)
    if not isinstance(world, int) or not ranks_per_node(ranks):
        return
    nodes = dict(stats.get("rank_nodes") or {})
    for r in ranks:
        if isinstance(r.get("rank"), int):
            nodes[str(r["rank"])] = r["node_id"]
    # A group of another size (an elastic resize) starts a new map.
    nodes = {k: v for k, v in nodes.items() if int(k) < world}
    stats["rank_nodes"] = nodes
    if len(nodes) == world:
        job.placement = ranks_per_node([{"node_id": n} for n in nodes.values()])


def ranks_per_node(ranks: Any) -> dict[str, int] | None:
    """{node id: ranks} from a ranks_started event's rank list (None when it is malformed)."""
    if not isinstance(ranks, list) or not ranks:
        return None
    out: dict[str, int] = {}
    for r in ranks:
        node = r.get("node_id") if isinstance(r, dict) else None
        if not isinstance(node, str) or not node:
            return None
        out[node] = out.get(node, 0) + 1
    return out


def _apply_checkpoint(
    session: Session, job: Job, kind: str, event: dict, iteration: int | None, ts: float | None, stats: dict
) -> None:
    ok = kind == "checkpoint_saved"
    seconds, size = number(event.get("seconds")), number(event.get("bytes"))
    uri = event.get("uri") if isinstance(event.get("uri"), str) else None
    row = Checkpoint(
        job_id=job.id,
        iteration=iteration,
        uri=uri,
        bytes=int(size) if size is not None else None,
        seconds=seconds,
        result="success" if ok else "failure",
        ts=ts or time.time(),
    )
    session.add(row)
    job_stats.count(stats, "checkpoints", row.result)
    retries = number(event.get("retries"))
    if retries is not None and retries > 0:  # storage errors the save got over (or gave up on)
        job_stats.add(stats, "ckpt_retries", retries)
    if not ok:
        return
    if iteration is not None:  # the job spec's evaluation.on_checkpoint (service/store/evals.py)
        evaluations_on_checkpoint(session, job, iteration)
    if seconds is not None:
        job_stats.observe(stats, "ckpt_save", job_stats.CHECKPOINT_BUCKETS, seconds)
    if size is not None:
        stats["ckpt_bytes"] = size
    latest = job.latest_checkpoint or {}
    if iteration is None or latest.get("iteration") is None or iteration >= latest["iteration"]:
        job.latest_checkpoint = {
            "iteration": iteration,
            "uri": uri,
            "bytes": row.bytes,
            "seconds": seconds,
            "ts": row.ts,
        }


def _apply_records(
    session: Session, job: Job, records: list[dict], stats: dict, result: IngestResult
) -> None:
    if not records:
        return
    batch: dict[int, tuple[int, dict]] = {}
    for record in records:  # one record per iteration: the newest run's
        epoch, iteration = contract.record_epoch(record, job.restarts), int(record["iteration"])
        if iteration not in batch or epoch >= batch[iteration][0]:
            batch[iteration] = (epoch, record)
    stored = dict(
        session.execute(
            select(JobMetric.iteration, JobMetric.epoch).where(
                JobMetric.job_id == job.id, JobMetric.iteration.in_(batch)
            )
        ).all()
    )
    now = time.time()
    inserts, applied = [], []
    for iteration in sorted(batch):
        epoch, record = batch[iteration]
        if iteration in stored:
            if stored[iteration] >= epoch:
                result.records_ignored += 1
                continue
            session.execute(
                update(JobMetric)
                .where(JobMetric.job_id == job.id, JobMetric.iteration == iteration)
                .values(record=record, epoch=epoch, recorded_at=now)
            )
            result.records_replaced += 1
        else:
            inserts.append(
                {
                    "job_id": job.id,
                    "iteration": iteration,
                    "epoch": epoch,
                    "recorded_at": now,
                    "record": record,
                }
            )
            result.records_accepted += 1
        applied.append((epoch, iteration, record))
        _count_record(stats, record)
        for ev in stragglers.observe(stats, record):  # per-rank step time (service/stragglers.py)
            add_event(session, job, ev["kind"], ev["message"], iteration=ev["iteration"], data=ev["data"])
    if inserts:
        session.execute(insert(JobMetric), inserts)
    if not applied:
        return
    epoch, top, newest = max(applied, key=lambda a: (a[0], a[1]))
    current = (job.iteration_epoch, job.current_iteration if job.current_iteration is not None else -1)
    if (epoch, top) >= current:  # a newer run, or further in the same run
        job.current_iteration, job.iteration_epoch = top, epoch
        job.last_record = newest
        job.last_progress_at = now
    if job.state in (JobState.QUEUED, JobState.STARTING):
        transition(session, job, JobState.RUNNING, f"first metrics record (iteration {top})", stats=stats)
    elif job.state == JobState.RESTARTING:
        transition(session, job, JobState.RUNNING, f"training resumed (iteration {top})", stats=stats)


def _count_record(stats: dict, record: dict) -> None:
    for field, key in (("tokens", "tokens"), ("energy_j", "energy_j")):
        value = number(record.get(field))
        if value is not None:
            job_stats.add(stats, key, value)
    if record.get("skipped") is True:
        job_stats.add(stats, "skipped", 1)
    step = number(record.get("step_time_s"))
    if step is not None:
        job_stats.observe(stats, "step", job_stats.STEP_BUCKETS, step)
        progress.observe_step(stats, step)
    if isinstance(record.get("timers"), dict) and record["timers"]:
        stats["timers"] = record["timers"]
    valid = number(record.get("valid_loss"))
    if valid is not None:
        stats["valid_loss"] = valid
