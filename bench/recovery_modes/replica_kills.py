"""What killing one replica over and over costs the replicas that survive it, against the same
job run without kills.

Mode survive (`"mode": "survive"`, `resilience.on_rank_failure: replace_replica`): the same SMALL
job and persistent checkpoints as sigkill_recovery's `persistent` mode, replica 1's rank
SIGKILLed every `--kill-every` seconds (default 30) while replica 0 trains on. Per kill:
`survivor_stall_s` (the survivors' longest step between the kill and two steps after the rejoin,
less their median step before the first kill; `at_kill_s` and `at_rejoin_s` split it),
`rejoin_s` (kill -> the first step of both replicas after the survivors' first step alone;
`replacement_started_s`, `heal_s`); over the run: `throughput_kept` (tokens trained per second
from the first kill to the end, over the same job's uninterrupted run, first in the same bench,
from the same moment on; `steps_kept` the same for steps; `vs_before_first_kill` over the run's
own half interval before its first kill; `vs_steady_between_kills` over the run's own steps in
the second half of each interval, measured beside the kills: two runs on this shared machine
differ by up to 10 %); `seconds_lost_per_kill`: each step's wall time past the same run's mean
step in the second halves of the intervals, summed by how long after the latest kill it ended,
and the tokens the steps without replica 1 did not train (`fewer_samples_s`); `cpu_cores`: where
the machine's CPU went in both runs, by process (the two replicas' ranks, Ray's and Ray Train's
processes, the warm processes). Every survive line carries `relay`: `--compare-no-relay` runs
the same kills again with torchft's Lighthouse alone (no liveness relay,
engine/fault_tolerance/lighthouse.py), against the same uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import statistics
import threading
import time
from pathlib import Path

from bench.recovery_modes.cpu_ledger import CpuLedger
from bench.recovery_modes.harness import MEDIUM, SMALL, WARMUP, Receiver, emit, job_spec, run_on_ray, wait_for

# replica 1 killed every this many seconds, in a job this long.
SURVIVE_KILL_EVERY_S = 30.0
SURVIVE_TRAIN_ITERS = 8000  # ~110 s at the SMALL job's ~13 ms step on 2 cores: three kills
SMOKE_SURVIVE = (2.0, 400, 1)  # one kill, while the job still runs (~13 ms steps on an idle machine)


def _rate(records: list[dict]) -> tuple[float, float] | None:
    """(tokens per second, steps per second) over consecutive records, or None for fewer than two."""
    if len(records) < 2:
        return None
    wall = records[-1]["ts"] - records[0]["ts"]
    return sum(r["tokens"] for r in records[1:]) / wall, (len(records) - 1) / wall


def _rank_pids(events: list[dict]) -> dict[int, int]:
    """Each rank process's replica, from the replicas' `replica_started` events."""
    return {r["pid"]: e["replica"] for e in events if e["kind"] == "replica_started" for r in e["ranks"]}


def _cpu_kind(pids: dict[int, int]):
    def kind(pid: int, title: str) -> str:
        if pid in pids:
            return f"replica {pids[pid]} ranks"
        return title.split(" ")[0].split(".")[0].rsplit("/", 1)[-1] or "?"

    return kind


def survive(
    receiver: Receiver,
    workdir: Path,
    repeat: int,
    kill_every_s: float = SURVIVE_KILL_EVERY_S,
    train_iters: int = SURVIVE_TRAIN_ITERS,
    max_kills: int | None = None,
    heartbeat_timeout_ms: int | None = None,
    job: str = "small",
    relays: tuple[bool, ...] = (True,),
    reference_run: bool = True,
) -> None:
    """`resilience.on_rank_failure: replace_replica`: the SMALL job (2 replicas, persistent
    checkpoints every 10 steps as in `persistent` mode) with replica 1's rank SIGKILLed every
    `kill_every_s` seconds (its pid from its `replica_started` event) until the job ends. Replica
    0 survives and reports every step; per kill: `survivor_stall_s`, `rejoin_s`; over the run:
    `throughput_kept`, `seconds_lost_per_kill`, `cpu_cores`. The throughput's reference is the
    same job run first without kills, in the same bench: its tokens/s from the same moment on as
    the first kill of the run with kills (both windows start after the warm processes have
    started). `vs_before_first_kill` keeps the older reference, the run's own steps in the half
    interval before the first kill: a window of a few seconds, noisier on a shared machine.
    `reference_run=False` (--smoke): no uninterrupted run, each run with kills is its own
    reference (the same lines and code, one Ray job fewer; its throughput figures mean nothing)."""
    job_id = f"survive-{job}-{repeat}-{heartbeat_timeout_ms or 0}"
    spec = job_spec(SMALL if job == "small" else MEDIUM, train_iters)
    spec["checkpoint"] = {"interval": 10, "path": str(workdir / "ckpt")}
    spec["resilience"] = {"on_rank_failure": "replace_replica", "max_restarts": 1000, "warm_restart": True}
    if heartbeat_timeout_ms is not None:
        spec["resilience"]["replica_heartbeat_timeout_ms"] = heartbeat_timeout_ms
    hb = spec["resilience"].get("replica_heartbeat_timeout_ms", 500)

    reference = None
    if reference_run:
        receiver.records.clear()
        receiver.events.clear()
        with CpuLedger() as reference_cpu:
            uninterrupted = run_on_ray(f"{job_id}-ref", spec, str(workdir / "runs-ref"))
        if uninterrupted.exit_code != 0:
            raise SystemExit(f"bench: the survive job's uninterrupted reference run failed: {uninterrupted}")
        ordered = sorted(receiver.records, key=lambda r: r["iteration"])
        reference = SurviveRun(ordered, list(receiver.events), [], reference_cpu)
    for relay in relays:
        receiver.records.clear()
        receiver.events.clear()
        killer = ReplicaKiller(receiver, kill_every_s, max_kills, last_iteration=train_iters)
        with CpuLedger() as run_cpu, killer:
            result = run_on_ray(
                job_id if relay else f"{job_id}-norelay", spec, str(workdir / "runs"), replica_relay=relay
            )
        if result.exit_code != 0 or not killer.kills:
            raise SystemExit(
                f"bench: the survive job failed or was never killed: {result}, kills {killer.kills}"
            )
        last = {}
        for r in receiver.records:  # the newest report of each iteration
            last[r["iteration"]] = r
        killed = SurviveRun([last[i] for i in sorted(last)], list(receiver.events), killer.kills, run_cpu)
        from engine.device import cpu_cores

        # Every line of this run carries the same keys (`cores`: which machine they come from).
        out = functools.partial(emit, mode="survive", relay=relay, job=job, repeat=repeat, cores=cpu_cores())
        _kill_figures(out, killed, hb)
        _run_figures(out, killed, reference or killed, kill_every_s, hb)


class ReplicaKiller:
    """SIGKILLs replica 1's rank every `kill_every_s` seconds from the run's first step (its pid
    from its newest `replica_started` event), while the `with` block runs and until the survivors
    have reported `last_iteration`; `kills` holds when. (Killing on after that measures nothing,
    and a job ends only once its last replica has: with kills closer together than a cold
    replacement takes to start, ~4.4 s on 2 cores, it would never end.)"""

    def __init__(self, receiver: Receiver, kill_every_s: float, max_kills: int | None, last_iteration: int):
        self.receiver, self.kill_every_s, self.max_kills = receiver, kill_every_s, max_kills
        self.last_iteration = last_iteration
        self.kills: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(timeout=60)

    def _replica_1_pid(self, after: float) -> int | None:
        started = [
            e
            for e in self.receiver.events
            if e["kind"] == "replica_started" and e.get("replica") == 1 and e["ts"] >= after
        ]
        return started[-1]["ranks"][0]["pid"] if started else None

    def _run(self) -> None:
        first = wait_for(lambda: self.receiver.records[:1])[0]["ts"]
        kills = self.kills
        while (self.max_kills is None or len(kills) < self.max_kills) and not self._done.wait(
            max(0.05, first + self.kill_every_s * (len(kills) + 1) - time.time())
        ):
            if any(r["iteration"] >= self.last_iteration for r in self.receiver.records[-50:]):
                return
            pid = self._replica_1_pid(kills[-1] if kills else 0.0)
            if pid is None:  # the last replacement has not started yet: kill it once it has
                continue
            kills.append(time.time())
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                kills.pop()


@dataclasses.dataclass
class SurviveRun:
    """One survive run as the bench saw it: replica 0's step records (one per iteration, in
    order), the run's events, when replica 1 was killed, and the machine's CPU meanwhile."""

    records: list[dict]
    events: list[dict]
    kills: list[float]
    cpu: CpuLedger

    def gaps(self) -> list[tuple[float, float, dict]]:
        """(end, wall time, record) of each step after the first."""
        recs = self.records
        return [(b["ts"], b["ts"] - a["ts"], b) for a, b in zip(recs, recs[1:], strict=False)]

    def since_kill(self, ts: float) -> float:
        return ts - max(k for k in self.kills if k <= ts)

    def first_event(self, kind: str, start: float, end: float, where=lambda event: True) -> dict:
        """The first `kind` event strictly between `start` and `end` that `where` accepts, or {}."""
        return next((e for e in self.events if e["kind"] == kind and start < e["ts"] < end and where(e)), {})


def _kill_figures(out, run: SurviveRun, hb: int) -> None:
    """Per kill: the survivors' stall (`survivor_stall_s`, at the kill and at the rejoin) and
    kill -> the replacement's first step in the quorum (`rejoin_s`)."""
    kills, gaps = run.kills, run.gaps()
    steady_gaps = [g for ts, g, b in gaps if b["iteration"] > WARMUP and ts < kills[0]]
    median = statistics.median(steady_gaps) if steady_gaps else statistics.median(g for _, g, _ in gaps)
    for n, killed_at in enumerate(kills):
        until = kills[n + 1] if n + 1 < len(kills) else float("inf")
        alone = [b for _, _, b in gaps if killed_at < b["ts"] < until and b.get("replicas") == 1]
        # the healed replica's event (the one that served the heal has no heal_s)
        rejoined = run.first_event("replica_rejoined", killed_at, until, lambda e: "heal_s" in e)
        # Back in the quorum: the first step of two replicas after the replacement healed (or
        # after the survivors' first step alone; a step that committed just after the kill was
        # the dead replica's last). A warm replacement can heal before the survivors step alone.
        since = rejoined.get("ts") or (alone[0]["ts"] if alone else None)
        back = next(
            (b for ts, _, b in gaps if since is not None and since < ts < until and b.get("replicas") == 2),
            None,
        )
        window_end = back["ts"] + 2 * median if back is not None else until
        around = [g for ts, g, _ in gaps if killed_at < ts <= window_end]
        at_kill = [g for ts, g, _ in gaps if killed_at < ts < (back["ts"] if back is not None else until)]
        started = run.first_event("replica_started", killed_at, until, lambda e: e.get("replica") == 1)
        out(
            figure="survivor_stall_s",
            value=round(max(around) - median, 3) if around else None,
            at_kill_s=round(max(at_kill) - median, 3) if at_kill else None,
            at_rejoin_s=round(next(g for ts, g, b in gaps if b is back) - median, 3)
            if back is not None
            else None,
            median_step_s=round(median, 4),
            heartbeat_timeout_ms=hb,
            steps_alone=len(alone),
            kill=n,
        )
        out(
            figure="rejoin_s",
            value=round(back["ts"] - killed_at, 2) if back is not None else None,
            replacement_started_s=round(started["ts"] - killed_at, 2) if started else None,
            process_age_s=started.get("process_age_s"),
            heal_s=rejoined.get("heal_s"),
            kill=n,
        )


def _run_figures(out, run: SurviveRun, reference: SurviveRun, kill_every_s: float, hb: int) -> None:
    """Over the run: `throughput_kept` against three references, `seconds_lost_per_kill` (where
    the throughput went) and `cpu_cores` (where the machine's CPU went)."""
    recs, kills = run.records, run.kills
    # The steady steps of the half interval before the first kill (the job's first seconds also
    # pay for starting its warm processes, one torch import per rank).
    before = [
        r for r in recs if WARMUP < r["iteration"] and kills[0] - kill_every_s / 2 <= r["ts"] < kills[0]
    ]
    after = [r for r in recs if r["ts"] >= kills[0]]
    # The uninterrupted run's steps from as long after its first step as the first kill came.
    ref_recs = reference.records
    offset = kills[0] - recs[0]["ts"]
    same_window = [r for r in ref_recs if r["ts"] >= ref_recs[0]["ts"] + offset] if ref_recs else []
    ref, before_rate, rate = _rate(same_window), _rate(before), _rate(after)
    # The same run's own steps far from any kill (ending in the second half of an interval): a
    # reference taken beside the kills, free of the several percent by which two runs on one
    # shared machine differ (seconds_lost_per_kill shows what a kill slows lasts < 8 s).
    calm = [
        (b["tokens"], b["ts"] - a["ts"])
        for a, b in zip(after, after[1:], strict=False)
        if run.since_kill(b["ts"]) >= kill_every_s / 2
    ]
    calm_rate = sum(t for t, _ in calm) / sum(g for _, g in calm) if calm else None
    out(
        figure="throughput_kept",
        value=round(rate[0] / ref[0], 3) if ref and rate else None,
        steps_kept=round(rate[1] / ref[1], 3) if ref and rate else None,
        vs_before_first_kill=round(rate[0] / before_rate[0], 3) if before_rate and rate else None,
        vs_steady_between_kills=round(rate[0] / calm_rate, 3) if calm_rate and rate else None,
        tokens_per_s_uninterrupted=round(ref[0], 1) if ref else None,
        tokens_per_s_before=round(before_rate[0], 1) if before_rate else None,
        tokens_per_s_with_kills=round(rate[0], 1) if rate else None,
        kill_every_s=kill_every_s,
        heartbeat_timeout_ms=hb,
        kills=len(kills),
        seconds_with_kills=round(after[-1]["ts"] - kills[0], 1) if after else None,
        steps_alone=sum(r.get("replicas") == 1 for r in recs),
    )
    if calm and rate:
        _seconds_lost_figure(out, run, after, sum(g for _, g in calm) / len(calm), kill_every_s, ref)
    if ref and rate:
        for name, side, rs in (("uninterrupted", reference, same_window), ("with_kills", run, after)):
            _cpu_figure(out, name, side, rs)


def _seconds_lost_figure(
    out, run: SurviveRun, after: list[dict], steady_step: float, kill_every_s: float, ref
) -> None:
    """Where the time went: each step's wall time past the same run's mean step far from the
    kills, summed by how long after the latest kill it ended (seconds lost per kill), and the
    tokens the steps without the killed replica did not train (as seconds of such steps)."""
    kills = run.kills
    full_tokens = max(r["tokens"] for r in after)
    bins = (0, 1, 2, 4, 8, 16, kill_every_s)
    lost = dict.fromkeys((f"{a:g}-{b:g}s" for a, b in zip(bins, bins[1:], strict=False)), 0.0)
    for a, b in zip(after, after[1:], strict=False):
        since = run.since_kill(b["ts"])
        for lo, hi in zip(bins, bins[1:], strict=False):
            if lo <= since < hi or (hi == bins[-1] and since >= hi):
                lost[f"{lo:g}-{hi:g}s"] += (b["ts"] - a["ts"] - steady_step) / len(kills)
                break
    out(
        figure="seconds_lost_per_kill",
        value=round(sum(lost.values()), 3),
        by_time_since_kill={k: round(v, 3) for k, v in lost.items()},
        fewer_samples_s=round(
            sum(steady_step * (1 - r["tokens"] / full_tokens) for r in after[1:]) / len(kills), 3
        ),
        steady_step_s=round(steady_step, 4),
        uninterrupted_step_s=round(1 / ref[1], 4) if ref else None,
    )


def _cpu_figure(out, name: str, run: SurviveRun, records: list[dict]) -> None:
    """Where the machine's CPU went over `records` (cores: CPU seconds per second), by process:
    the two replicas' ranks and everything else (Ray's own processes, Ray Train's controller, the
    warm processes started for the next replacement, this bench)."""
    wall = records[-1]["ts"] - records[0]["ts"]
    used = run.cpu.used(records[0]["ts"], records[-1]["ts"], _cpu_kind(_rank_pids(run.events)))
    out(
        figure="cpu_cores",
        run=name,
        total=round(sum(used.values()) / wall, 3),
        by_process={
            k: round(v / wall, 3) for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v / wall >= 0.005
        },
        seconds=round(wall, 1),
    )
