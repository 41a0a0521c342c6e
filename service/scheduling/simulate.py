"""Replay a trace of jobs through the scheduler's pure decision (service/scheduling/decision.py)
on a simulated clock.

The property tests and bench/scheduler.py drive `decide` exactly as the reconciler does: a
decision after every arrival, completion and finished stop, admissions started at once,
preemptions and shrinks taking `checkpoint_s` (the job saves at its current step and stops,
holding its room until then), a preempted job requeued with the work it had left. Work is
measured in seconds at the job's nominal size (`Job.ranks`); an elastic job on n ranks makes
progress at n / ranks of that rate (data parallelism).

With `live_resize_s` set, elastic jobs resize as `resilience.resize: live` does
(workers/replica_fits.py): a shrink releases its ranks after `live_resize_s` and a grow's new
ranks train after it, while the others train on (no checkpoint, no restart); only the released
or added ranks' GPU-time for those seconds is lost. A preemption is still a stop.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from service.scheduling.decision import Decision, decide
from service.scheduling.model import Job, Node, Policy, Quota, Running
from service.scheduling.placement import never_fits


@dataclass(frozen=True)
class TraceJob:
    job: Job  # job.submitted_at is its arrival
    work_s: float  # run time at job.ranks ranks


@dataclass
class Outcome:
    """What happened to one job."""

    job: Job
    admitted_at: float | None = None  # first admission
    finished_at: float | None = None
    refused: str | None = None
    preemptions: int = 0
    resizes: int = 0


@dataclass
class SimResult:
    outcomes: dict[str, Outcome]
    busy_gpu_s: float = 0.0  # allocated GPU-seconds while the queue was non-empty
    capacity_gpu_s: float = 0.0  # the cluster's GPU-seconds while the queue was non-empty
    lost_gpu_s: float = 0.0  # GPU-seconds spent stopping and restarting for preemptions and shrinks
    lost_resize_gpu_s: float = 0.0  # of which for resizes (the rest: preemptions)
    decisions: int = 0
    end: float = 0.0

    @property
    def utilisation(self) -> float:
        return self.busy_gpu_s / self.capacity_gpu_s if self.capacity_gpu_s else 1.0


@dataclass
class _Run:
    running: Running
    left_s: float  # work left, at nominal size
    since: float  # progress counted up to here
    paused_until: float = 0.0  # restarting after a resize: no progress


def _rate(r: Running) -> float:
    return r.ranks / r.job.ranks


@dataclass
class Simulation:
    nodes: Sequence[Node]
    quotas: Mapping[str, Quota] = field(default_factory=dict)
    policy: Policy = Policy()
    checkpoint_s: float = 60.0  # a save at the current step and a stop (preemption, shrink)
    restart_s: float = 60.0  # a resumed job's start-up before it makes progress again
    live_resize_s: float | None = None  # an elastic job's live shrink or grow (None: stop and restart)
    # Called after every decision with (now, decision, running before it, queued): the property
    # tests check their invariants here.
    observe: Callable[[float, Decision, Sequence[Running], Sequence[Job]], None] | None = None
    decide_fn: Callable[..., Decision] = decide

    def run(self, trace: Sequence[TraceJob], horizon_s: float = float("inf")) -> SimResult:
        gpus = sum(n.gpus for n in self.nodes if n.alive)
        outcomes = {t.job.id: Outcome(t.job) for t in trace}
        work = {t.job.id: t.work_s for t in trace}
        result = SimResult(outcomes)
        seq = itertools.count()
        events: list[tuple[float, int, str, str]] = [(t.job.submitted_at, next(seq), "arrive", t.job.id) for t in trace]
        heapq.heapify(events)
        jobs = {t.job.id: t.job for t in trace}
        queued: dict[str, Job] = {}
        runs: dict[str, _Run] = {}
        # id -> ("stop", 0, the job it yields to or None) | ("shrink", new size, new placement)
        stopping: dict[str, tuple] = {}
        now = 0.0

        def advance(to: float) -> None:
            nonlocal now
            if queued:
                busy = sum(r.running.ranks * r.running.job.shape.gpus for r in runs.values())
                result.busy_gpu_s += busy * (to - now)
                result.capacity_gpu_s += gpus * (to - now)
            for r in runs.values():
                start = max(r.since, r.paused_until)
                if to > start:
                    r.left_s -= (to - start) * _rate(r.running)
                r.since = to
            now = to

        def schedule_finish(job_id: str) -> None:
            r = runs[job_id]
            start = max(now, r.paused_until)
            heapq.heappush(events, (start + max(r.left_s, 0.0) / _rate(r.running), next(seq), "finish", job_id))

        while events and now <= horizon_s:
            t, _, kind, job_id = heapq.heappop(events)
            advance(t)
            if kind == "arrive":
                refusal = never_fits(jobs[job_id], self.nodes, self.quotas.get(jobs[job_id].tenant))
                if refusal:
                    outcomes[job_id].refused = refusal
                    continue
                queued[job_id] = jobs[job_id]
            elif kind == "finish":
                r = runs.get(job_id)
                if r is None or job_id in stopping or r.left_s > 1e-6 * max(1.0, work[job_id]):
                    continue  # a stale event: the job was resized or stopped since
                del runs[job_id]
                outcomes[job_id].finished_at = now
            elif kind == "stopped":
                what, size, placement = stopping.pop(job_id)  # placement: a shrink's; a stop's yields_to
                r = runs[job_id]
                if what == "live":  # the released ranks' seconds; the others trained on
                    lost = (r.running.ranks - size) * r.running.job.shape.gpus * self.live_resize_s
                else:
                    lost = r.running.ranks * r.running.job.shape.gpus * (self.checkpoint_s + self.restart_s)
                result.lost_gpu_s += lost
                if what != "stop":
                    result.lost_resize_gpu_s += lost
                if what == "live":
                    r.running = Running(r.running.job, placement, r.running.backfilled_for)
                    outcomes[job_id].resizes += 1
                    schedule_finish(job_id)
                elif what == "stop":
                    del runs[job_id]
                    # Requeued with the credit its waits earned; the new wait counts from now.
                    queued[job_id] = replace(r.running.job, waiting_since=now, yields_to=placement)
                    work[job_id] = r.left_s
                    outcomes[job_id].preemptions += 1
                else:
                    r.running = Running(r.running.job, placement, r.running.backfilled_for)
                    r.paused_until = now + self.restart_s
                    outcomes[job_id].resizes += 1
                    schedule_finish(job_id)
            decision = self.decide_fn(
                self.nodes,
                [r.running for r in runs.values()],
                list(queued.values()),
                self.quotas,
                now,
                self.policy,
                stopping=set(stopping),
            )
            result.decisions += 1
            if self.observe is not None:
                self.observe(now, decision, [r.running for r in runs.values()], list(queued.values()))
            for a in decision.admit:
                job = queued.pop(a.job_id)
                since = job.waiting_since if job.waiting_since is not None else job.submitted_at
                job = replace(job, waited_s=job.waited_s + now - since, waiting_since=None, yields_to=None)
                runs[a.job_id] = _Run(
                    Running(job, a.placement, a.backfilled_for),
                    work[a.job_id],
                    now,
                    paused_until=now + (self.restart_s if outcomes[a.job_id].preemptions else 0.0),
                )
                if outcomes[a.job_id].admitted_at is None:
                    outcomes[a.job_id].admitted_at = now
                schedule_finish(a.job_id)
            for p in decision.preempt:
                stopping[p.job_id] = ("stop", 0, p.for_job if p.reclaimed else None)
                heapq.heappush(events, (now + self.checkpoint_s, next(seq), "stopped", p.job_id))
            for z in decision.resize:
                r = runs[z.job_id]
                live = self.live_resize_s is not None and r.running.job.lo < r.running.job.hi
                if z.ranks < r.running.ranks:
                    stopping[z.job_id] = ("live" if live else "shrink", z.ranks, z.placement)
                    wait = self.live_resize_s if live else self.checkpoint_s
                    heapq.heappush(events, (now + wait, next(seq), "stopped", z.job_id))
                    continue
                # a grow: the room is taken now; progress resumes after a restart, or (live) the
                # added ranks train after live_resize_s, the others never stopped
                if live:
                    lost = (z.ranks - r.running.ranks) * r.running.job.shape.gpus * self.live_resize_s
                else:
                    lost = z.ranks * r.running.job.shape.gpus * self.restart_s
                    r.paused_until = now + self.restart_s
                r.running = Running(r.running.job, z.placement, r.running.backfilled_for)
                result.lost_gpu_s += lost
                result.lost_resize_gpu_s += lost
                outcomes[z.job_id].resizes += 1
                schedule_finish(z.job_id)
        result.end = now
        return result
