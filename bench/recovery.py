"""Recovery and overhead of jobs on Ray (workers/), against references in the same process.

Figures (one JSON line each):

- recovery, once per mode: a 2-rank job on local Ray, one rank killed with SIGKILL mid-interval
  between two persistent checkpoints (its pid from the rank's own report), once the job has
  trained for SETTLE_S seconds (its warm processes for a restart are ready by then). Every line carries
  `"mode"`: `persistent` (persistent checkpoints only, every 10 steps: the "before") or `memory`
  (the same plus in-memory checkpoints every step, `checkpoint.local_interval: 1`: the "after").
  `sigkill_to_first_step_s`: from the kill to the first step completed after the resume, split
  into `detect_s` (kill -> the driver has the failure), `restart_s` (-> the new ranks are up) and
  `resume_s` (-> the resumed job's first step); `steps_reexecuted`: steps done before the kill
  that ran again; `restart_breakdown_s`: the new group's phases as rank 0's `recovered` event
  reports them (group start: fit() -> the rank function runs, i.e. Ray Train's worker actors,
  their placement group and the torch process group; imports; registry and telemetry; model
  build + persistent resume; the agreement over the in-memory snapshots; their restore) and
  where it recovered from; `ratio_over_cold_start`: the recovery time over the same job's cold
  start (fit() -> its first step) in the same run.
- survive (`"mode": "survive"`, `resilience.on_rank_failure: replace_replica`): the same SMALL job
  and persistent checkpoints as `persistent`, replica 1's rank SIGKILLed every `--kill-every`
  seconds (default 30) while replica 0 trains on. Per kill: `survivor_stall_s` (the survivors'
  longest step between the kill and two steps after the rejoin, less their median step before
  the first kill; `at_kill_s` and `at_rejoin_s` split it), `rejoin_s` (kill -> the first step
  of both replicas after the survivors' first step alone; `replacement_started_s`, `heal_s`);
  over the run: `throughput_kept` (tokens trained per second from the first kill to the end,
  over the same job's uninterrupted run, first in the same bench, from the same moment on;
  `steps_kept` the same for steps; `vs_before_first_kill` over the run's own half interval
  before its first kill; `vs_steady_between_kills` over the run's own steps in the second half
  of each interval, measured beside the kills: two runs on this shared machine differ by up to
  10 %); `seconds_lost_per_kill`: each step's wall time past the same run's mean
  step in the second halves of the intervals, summed by how long after the latest kill it ended, and the tokens the steps
  without replica 1 did not train (`fewer_samples_s`); `cpu_cores`: where the machine's CPU
  went in both runs, by process (the two replicas' ranks, Ray's and Ray Train's processes, the
  warm processes). Every survive line carries `relay`: `--compare-no-relay` runs the same kills
  again with torchft's Lighthouse alone (no liveness relay, engine/distributed/lighthouse.py),
  against the same uninterrupted run.
- snapshot_overhead: the MEDIUM job on Ray without and with `local_interval: N`
  (`--local-interval`, default 1), alternating `--rounds` times (each first in every other round): mean wall seconds per
  steady-state iteration (the snapshot is taken between steps, outside the engine's
  `step_time_s`) and their ratio (`mode` none / memory).
- snapshot_overhead_interleaved: one Ray job with a snapshot every third step, each
  snapshot's cost read against the clean step of its cycle (see the function): drift-free;
  median and quartiles over the cycles. It charges a snapshot with everything that slows the
  two steps around it, so it reads above the every-step pairs: an upper bound.
- snapshot_work_ratio: the same job's ranks outside Ray (the engine's launcher), every step
  followed by a snapshot captured and sealed on the training thread, each timed: 1 + (capture +
  seal) / step, per rank and layout (plain DP=2; ZeRO-1 over DP=2), with the snapshot's bytes
  against the state's (a rank keeps its slice of what its data-parallel replicas share). The
  CPU the snapshots add, free of the several percent by which wall time swings between two jobs
  on a shared machine. `param_shaped_optim_ms`: the persistent checkpoint's optimizer part on
  the same rank (parameter-shaped, assembled over DP under ZeRO-1), which snapshots no longer
  build.
- overhead: the same spec trained by the engine's local launcher (what `elastron train` runs:
  `engine.launcher.spawn(train_rank)`) and by `workers` on Ray, steady-state iterations only,
  alternating `--rounds` times; `ratio_ray_over_local` for the step time the engine measures
  (`step_time_s`, the same code in both) and for the wall time per iteration (the loop,
  telemetry included), per round and the median.
- telemetry: what one `TelemetrySender.record()` call (rank 0's per-step cost) takes while the
  sender thread POSTs batches to a live receiver.
- storage_fault, once per storage fault (issue 34): a 2-rank job outside Ray (the fault matrix's
  supervisor, tests/faults/matrix.py) with synchronous saves every 2 steps, its iteration-4 save
  hit by S3 answering 500, 503 or SlowDown, or resetting connections mid-upload, for one whole
  try of the save (a fault-injecting proxy in front of a moto server started here, botocore
  allowed 2 retries so the checkpointer's own retry is what gets over it), or by a full disk
  (a small tmpfs: root only, else the line says it was skipped). `time_lost_s`: the job's wall
  time (its first record to its last) over a clean run's (target: the retry time only); `retry_s`: the faulted save's time
  over the clean run's save of the same iteration; `steps_lost` (target 0) and `restarts`
  (target 0); medians over `--repeats`.

    python bench/recovery.py [--repeats 1] [--rounds 3] [--iterations 40]
        [--skip recovery|survive|overhead|snapshot_overhead|storage_faults]
        [--kill-every 30] [--heartbeat-timeout-ms MS ...] [--survive-job small|medium]
        [--survive-iters N] [--compare-no-relay] [--ray-cpus 2] [--smoke]

`--smoke`: every figure above, each from the fewest steps, rounds and calls that still make it
(one round, short jobs, the kill after SMOKE_SETTLE_S): a check that the bench runs, not a
measurement. Most of its time is Ray: starting the local cluster, then the worker groups of
its Ray jobs (the recovery's restart and the survive job's replacement); the recovery runs
the memory mode only (its code path includes the persistent mode's), the survive job's run with
kills is its own throughput reference (no uninterrupted run), and the overhead figure's Ray side
reuses snapshot_overhead's plain run (the same spec).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = {
    "name": "bench-recovery",
    "model": {
        "arch": "llama",
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
    },
    "data": {"source": "text"},
    "training": {"global_batch_size": 4, "micro_batch_size": 2, "train_iters": 1000, "seed": 5},
    "optimizer": {"lr": 2e-3},
    "checkpoint": {"interval": 10},
    "resources": {"ranks": 2, "device": "cpu"},
}
# Big enough that a step is tens of milliseconds, so per-step overheads show.
MEDIUM = {
    "name": "bench-overhead",
    "model": {
        "arch": "llama",
        "num_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "seq_length": 128,
    },
    "data": {"source": "synthetic"},
    "training": {
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "train_iters": 60,
        "seed": 5,
        "log_interval": 1000,
    },
    "optimizer": {"lr": 1e-4},
    "resources": {"ranks": 2, "device": "cpu"},
}
WARMUP = 5
# Seconds a recovery job trains before the kill.
SETTLE_S = 15.0
TRAIN_ITERS = {"persistent": 1500, "memory": 700}
# --smoke: the kill after this long (warm processes may still be starting: a slower restart),
# in jobs this long (still longer than the kill takes to land).
SMOKE_SETTLE_S = 2.0
SMOKE_TRAIN_ITERS = {"memory": 60}
# mode survive (replace_replica): replica 1 killed every this many seconds, in a job this long.
SURVIVE_KILL_EVERY_S = 30.0
SURVIVE_TRAIN_ITERS = 8000  # ~110 s at the SMALL job's ~13 ms step on 2 cores: three kills
SMOKE_SURVIVE = (2.0, 400, 1)  # one kill, while the job still runs (~13 ms steps on an idle machine)


def emit(**fields) -> None:
    print(json.dumps({"bench": "recovery", **fields}), flush=True)


class Receiver:
    """The control plane's telemetry endpoint, reduced to collecting what arrives."""

    def __init__(self):
        self.records: list[dict] = []
        self.events: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.records.extend(batch["records"])
                outer.events.extend(batch["events"])
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def wait_for(what, timeout_s: float = 600):
    deadline = time.monotonic() + timeout_s
    while not (value := what()):
        if time.monotonic() > deadline:
            raise TimeoutError("bench: gave up waiting")
        time.sleep(0.01)
    return value


class CpuLedger:
    """Every process's CPU seconds on this machine, sampled from /proc every `every_s`, so a
    window's CPU can be split by who used it (the bench's ranks share 2 cores with everything a
    replacement starts). Linux only; elsewhere it records nothing."""

    def __init__(self, every_s: float = 0.5):
        self.every_s = every_s
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu-ledger", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)

    def _read(self) -> dict[int, tuple[str, float]]:
        seen = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    title = f.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            # utime, stime: fields 14 and 15 of stat, 12 and 13 after the ")".
            seen[int(entry.name)] = (title, (int(fields[11]) + int(fields[12])) / self._tick)
        return seen

    def _run(self) -> None:
        if not os.path.isdir("/proc"):
            return
        while not self._stop.is_set():
            self.samples.append((time.time(), self._read()))
            self._stop.wait(self.every_s)

    def used(self, start: float, end: float, kind=lambda pid, title: title) -> dict[str, float]:
        """CPU seconds per kind(pid, title) between the samples nearest `start` and `end` (a
        process born inside the window counts from zero; one that died inside it, up to its last
        sample)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {}
        first, spent = inside[0][1], {}
        last_seen: dict[int, tuple[str, float]] = {}
        for _, procs in inside[1:]:
            last_seen.update(procs)
        for pid, (title, cpu) in last_seen.items():
            name = kind(pid, title)
            spent[name] = spent.get(name, 0.0) + cpu - first.get(pid, (title, 0.0))[1]
        return spent


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


def run_on_ray(job_id: str, spec: dict, storage: str, **options):
    from engine.jobspec import parse_job
    from workers.driver import WorkerRunOptions, run_job

    return run_job(
        job_id,
        parse_job(spec),
        WorkerRunOptions(storage_path=storage, quiet=True, flush_interval_s=0.1, **options),
    )


def recovery(
    receiver: Receiver,
    workdir: Path,
    repeat: int,
    mode: str,
    settle_s: float = SETTLE_S,
    train_iters: dict[str, int] = TRAIN_ITERS,
) -> None:
    job_id = f"recovery-{mode}-{repeat}"
    spec = json.loads(json.dumps(SMALL))
    spec["checkpoint"]["path"] = str(workdir / "ckpt")
    if mode == "memory":
        spec["checkpoint"]["local_interval"] = 1
    # Long enough to outlast SETTLE_S on this machine (a snapshot every step makes the memory
    # job's tiny steps slower), not much longer: the job trains to the end after the recovery.
    spec["training"]["train_iters"] = train_iters[mode]
    spec["resilience"] = {"max_restarts": 1}
    marks: dict = {}

    def kill():
        started = wait_for(lambda: [e for e in receiver.events if e["kind"] == "ranks_started"][-1:])
        victim = next(r for r in started[0]["ranks"] if r["rank"] == 1)
        # A job that has run a while (its warm processes are ready: a failure in a job's first
        # seconds meets cold processes, as its cold start did), killed mid-interval: the newest
        # persistent checkpoint is 5-9 steps old.
        settled = started[0]["ts"] + settle_s
        interval = SMALL["checkpoint"]["interval"]
        late = train_iters[mode] // 2  # a fast machine: do not wait for the job's end
        wait_for(
            lambda: any(
                (r["ts"] >= settled or r["iteration"] >= late) and r["iteration"] % interval >= interval // 2
                for r in receiver.records
            )
        )
        marks["killed_at"] = time.time()
        os.kill(victim["pid"], signal.SIGKILL)

    receiver.records.clear()
    receiver.events.clear()
    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    marks["fit_at"] = time.time()
    result = run_on_ray(job_id, spec, str(workdir / "runs"))
    killer.join(timeout=60)
    if result.exit_code != 0 or "killed_at" not in marks:
        raise SystemExit(f"bench: the job did not recover: {result}")
    records = receiver.records
    before = [r for r in records if r["attempt"] == 0 and r["ts"] <= marks["killed_at"]]
    after = [r for r in records if r["attempt"] == 1]
    failed = next(e for e in receiver.events if e["kind"] == "attempt_failed")
    restarted = next(e for e in receiver.events if e["kind"] == "ranks_started" and e["attempt"] == 1)
    first_started = next(e for e in receiver.events if e["kind"] == "ranks_started" and e["attempt"] == 0)
    recovered = next((e for e in receiver.events if e["kind"] == "recovered"), {})
    cold = min(r["ts"] for r in records if r["attempt"] == 0) - marks["fit_at"]
    seconds = after[0]["ts"] - marks["killed_at"]
    resumed_from = after[0]["iteration"] - 1
    emit(
        mode=mode,
        figure="sigkill_to_first_step_s",
        value=round(seconds, 2),
        detect_s=round(failed["ts"] - marks["killed_at"], 2),
        restart_s=round(restarted["ts"] - failed["ts"], 2),
        resume_s=round(after[0]["ts"] - restarted["ts"], 2),
        repeat=repeat,
    )
    emit(
        mode=mode,
        figure="steps_reexecuted",
        value=max(r["iteration"] for r in before) - resumed_from,
        killed_after_iteration=max(r["iteration"] for r in before),
        resumed_from=resumed_from,
        recovered_from=recovered.get("recovered_from"),
        steps_lost_reported=recovered.get("steps_lost"),
        checkpoint_interval=SMALL["checkpoint"]["interval"],
        repeat=repeat,
    )
    emit(
        mode=mode,
        figure="restart_breakdown_s",
        value=recovered.get("phase_seconds"),
        first_step_after_rank_start_s=round(after[0]["ts"] - restarted["ts"], 2),
        recovered_from=recovered.get("recovered_from"),
        warm_process=recovered.get("warm_process"),
        repeat=repeat,
    )
    emit(
        mode=mode,
        figure="cold_start_to_first_step_s",
        value=round(cold, 2),
        ranks_up_s=round(first_started["ts"] - marks["fit_at"], 2),
        repeat=repeat,
    )
    emit(mode=mode, figure="ratio_over_cold_start", value=round(seconds / cold, 3), repeat=repeat)


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
    spec = json.loads(json.dumps(SMALL if job == "small" else MEDIUM))
    spec["checkpoint"] = {"interval": 10, "path": str(workdir / "ckpt")}
    spec["training"]["train_iters"] = train_iters
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


def snapshot_overhead(
    receiver: Receiver, workdir: Path, iterations: int, rounds: int, local_interval: int = 1
) -> dict[int, list[dict]]:
    """Wall time per steady-state iteration on Ray without and with in-memory snapshots every step.
    Returns each round's records of the run without snapshots (the overhead figure's Ray run in
    --smoke: the same spec)."""
    base = {"model": "llama-4L-h256-s128-b8", "ranks": 2}
    walls: dict[str, list[float]] = {"none": [], "memory": []}
    plain: dict[int, list[dict]] = {}  # round -> the records of its run without snapshots
    for r in range(rounds):
        # Each mode first in every other round: the first job of a round starts while the last
        # one's processes are still going away.
        for mode in ("none", "memory") if r % 2 == 0 else ("memory", "none"):
            spec = json.loads(json.dumps(MEDIUM))
            spec["training"]["train_iters"] = iterations
            if mode == "memory":
                spec["checkpoint"] = {"local_interval": local_interval}
                # The snapshots' per-step cost only: the warm processes' one-time start (seconds
                # of imports in new processes, on two cores) is the recovery figure's business.
                spec["resilience"] = {"warm_restart": False}
            receiver.records.clear()
            result = run_on_ray(f"snapshots-{mode}-{r}", spec, str(workdir / f"runs-{mode}-{r}"))
            if result.exit_code != 0:
                raise SystemExit(f"bench: the Ray run failed: {result}")
            if mode == "none":
                plain[r] = list(receiver.records)
            step, _ = steady(receiver.records)
            # The mean, not the median: with local_interval > 1 only every N-th step snapshots.
            recs = sorted(
                (r for r in receiver.records if r["iteration"] > WARMUP), key=lambda r: r["iteration"]
            )
            wall = (recs[-1]["ts"] - recs[0]["ts"]) / (recs[-1]["iteration"] - recs[0]["iteration"])
            walls[mode].append(wall)
            emit(
                mode=mode,
                local_interval=local_interval if mode == "memory" else None,
                figure="wall_s_per_iteration",
                **base,
                round=r,
                value=round(wall, 4),
                step_time_s=round(step, 4),
            )
    ratios = [m / n for m, n in zip(walls["memory"], walls["none"], strict=True)]
    emit(
        mode="memory",
        figure="snapshot_overhead_ratio",
        local_interval=local_interval,
        **base,
        value=round(statistics.median(ratios), 3),
        per_round=[round(x, 3) for x in ratios],
        rounds=rounds,
    )
    return plain


def snapshot_overhead_interleaved(receiver: Receiver, workdir: Path, cycles: int = 60) -> None:
    """One Ray job with a snapshot every 3rd step, so that the cost shows step by step against
    clean steps of the same job (the wall time of two jobs differs by more than the overhead on
    a shared machine). Records carry rank 0's time when it hands them on, after the step's
    snapshot was captured: iteration 3k's wall time holds the capture, 3k+1's the background seal
    and push it overlaps, 3k+2 is clean. Per cycle, (w[3k] + w[3k+1] - 2 w[3k+2]) / w[3k+2] is
    what a snapshot adds to one step: the overhead of a snapshot every step."""
    spec = json.loads(json.dumps(MEDIUM))
    start = WARMUP + (-WARMUP % 3)  # the first cycle starts at a multiple of 3
    spec["training"]["train_iters"] = start + 3 * cycles + 1
    spec["checkpoint"] = {"local_interval": 3}
    spec["resilience"] = {"warm_restart": False}
    receiver.records.clear()
    result = run_on_ray("snapshots-interleaved", spec, str(workdir / "runs-interleaved"))
    if result.exit_code != 0:
        raise SystemExit(f"bench: the Ray run failed: {result}")
    ts = {r["iteration"]: r["ts"] for r in receiver.records}
    wall = {i: ts[i] - ts[i - 1] for i in ts if i - 1 in ts}
    costs = [
        (wall[k] + wall[k + 1] - 2 * wall[k + 2]) / wall[k + 2]
        for k in range(start + 3, start + 3 * cycles, 3)
        if all(i in wall for i in (k, k + 1, k + 2))
    ]
    quartiles = statistics.quantiles(costs, n=4)
    clean = statistics.median(wall[k + 2] for k in range(start + 3, start + 3 * cycles, 3) if k + 2 in wall)
    emit(
        mode="memory",
        figure="snapshot_overhead_interleaved",
        model="llama-4L-h256-s128-b8",
        ranks=2,
        value=round(1 + statistics.median(costs), 4),
        p25=round(1 + quartiles[0], 4),
        p75=round(1 + quartiles[2], 4),
        cycles=len(costs),
        clean_step_s=round(clean, 4),
    )


def _stamp(record: dict) -> None:
    record["ts"] = time.time()  # the same dict train_rank keeps and returns


def local_run(spec: dict) -> list[dict]:
    from engine.launcher import spawn
    from engine.train_loop import train_rank

    return spawn(train_rank, 2, (spec, None, True, None, _stamp), timeout_s=1800)[0]


def steady(records: list[dict]) -> tuple[float, float]:
    """(median step_time_s, median wall seconds per iteration) after the warm-up."""
    recs = [r for r in records if r["iteration"] > WARMUP]
    walls = [
        b["ts"] - a["ts"]
        for a, b in zip(recs, recs[1:], strict=False)
        if b["iteration"] == a["iteration"] + 1
    ]
    return statistics.median(r["step_time_s"] for r in recs), statistics.median(walls)


def overhead(
    receiver: Receiver, workdir: Path, iterations: int, rounds: int, ray_runs: dict[int, list[dict]] | None = None
) -> None:
    """Local and Ray runs alternate, so load from elsewhere on the machine hits both. `ray_runs`:
    the records of Ray runs of this spec already made (--smoke: snapshot_overhead's plain run)."""
    spec = json.loads(json.dumps(MEDIUM))
    spec["training"]["train_iters"] = iterations
    base = {"model": "llama-4L-h256-s128-b8", "ranks": 2}
    ratios: dict[str, list[float]] = {"step_time_s": [], "wall_s_per_iteration": []}
    for r in range(rounds):
        local = steady(local_run(spec))
        if ray_runs and r in ray_runs:
            on_ray = steady(ray_runs[r])
        else:
            receiver.records.clear()
            result = run_on_ray(f"overhead-{r}", spec, str(workdir / f"runs-{r}"))
            if result.exit_code != 0:
                raise SystemExit(f"bench: the Ray run failed: {result}")
            on_ray = steady(receiver.records)
        for i, figure in enumerate(ratios):
            ratios[figure].append(on_ray[i] / local[i])
            emit(
                figure=figure,
                **base,
                round=r,
                local=round(local[i], 4),
                ray=round(on_ray[i], 4),
                ratio_ray_over_local=round(on_ray[i] / local[i], 3),
            )
    for figure, values in ratios.items():
        emit(
            figure=f"{figure}_ratio_ray_over_local",
            **base,
            value=round(statistics.median(values), 3),
            rounds=rounds,
        )


def _snapshot_work(spec: dict, steps: int) -> dict:
    """Rank function: the MEDIUM job's steps, each followed by a snapshot captured and sealed on
    the training thread, every part timed (medians after the warm-up)."""
    from engine import parallel_state as ps
    from engine.checkpointing.state import OptimizerState
    from engine.jobspec import JobSpec
    from engine.training import Trainer

    trainer = Trainer(JobSpec.model_validate(spec))
    buffer, times = None, {"step": [], "capture": [], "seal": [], "param_shaped_optim": []}
    # What the optimizer part of a persistent checkpoint builds (parameter-shaped, assembled over
    # DP under ZeRO-1): the snapshots' optimizer part before it kept the optimizer's own shards.
    persistent_optim = OptimizerState(trainer.optimizer, trainer.model_chunks, trainer.ddp_chunks)
    for i in range(WARMUP + steps):
        t0 = time.perf_counter()
        trainer.train_step()
        t1 = time.perf_counter()
        snap = trainer.capture_snapshot(buffer)
        t2 = time.perf_counter()
        snap.seal()
        t3 = time.perf_counter()
        persistent_optim.state_dict()
        t4 = time.perf_counter()
        buffer = snap.block.obj
        if i >= WARMUP:
            for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[name].append(seconds)
    out = {name: statistics.median(v) for name, v in times.items()}
    out["block_bytes"] = len(snap.block)
    out["state_bytes"] = sum(row[5] for row in snap.index)
    ps.destroy_model_parallel()
    return out


def snapshot_work(steps: int = 30) -> None:
    """The CPU an every-step snapshot adds, measured inside the ranks (the wall-clock ratio above
    swings by several percent between jobs on a shared 2-core machine): capture + seal over the
    step time of the same run, per rank."""
    from engine.launcher import spawn

    for layout, parallel in (("dp2", {}), ("zero1-dp2", {"distributed_optimizer": True})):
        spec = json.loads(json.dumps(MEDIUM))
        spec["training"]["train_iters"] = WARMUP + steps
        spec["parallel"] = parallel
        for rank, r in enumerate(spawn(_snapshot_work, 2, (spec, steps), timeout_s=1800)):
            emit(
                mode="memory",
                figure="snapshot_work_ratio",
                model="llama-4L-h256-s128-b8",
                layout=layout,
                rank=rank,
                value=round(1 + (r["capture"] + r["seal"]) / r["step"], 4),
                step_ms=round(r["step"] * 1e3, 1),
                capture_ms=round(r["capture"] * 1e3, 2),
                seal_ms=round(r["seal"] * 1e3, 2),
                param_shaped_optim_ms=round(r["param_shaped_optim"] * 1e3, 2),
                snapshot_bytes=r["block_bytes"],
                state_bytes=r["state_bytes"],
            )


def telemetry_cost(receiver: Receiver, calls: int = 20000) -> None:
    """What rank 0's per-step telemetry costs the training loop: one `record()` call, measured
    while the sender thread batches and POSTs to a live receiver."""
    from workers.telemetry import TelemetrySender, telemetry_url

    with tempfile.TemporaryDirectory() as spool:
        sender = TelemetrySender(
            telemetry_url(receiver.url, "cost"), "cost", "rank-0", spool_dir=spool, flush_interval_s=0.05
        ).start()
        record = {"iteration": 0, "loss": 1.0, "timers": {"forward-backward": [0.1, 0.2]}, "rerun": {}}
        samples = []
        for i in range(calls):
            t = time.perf_counter_ns()
            sender.record({**record, "iteration": i, "ts": time.time()})
            samples.append(time.perf_counter_ns() - t)
        sender.close(30)
    samples.sort()
    emit(
        figure="telemetry_record_call_us",
        value=round(statistics.median(samples) / 1000, 2),
        p99_us=round(samples[int(0.99 * len(samples))] / 1000, 2),
        calls=calls,
        delivered_batches=sender.delivered_batches,
    )


def _fault_run(spec: dict, work: Path, env: dict | None = None) -> dict:
    """One supervised run: wall seconds, restarts, steps re-run, and each save's seconds/retries."""
    from tests.faults.matrix import supervise

    run = supervise(spec, None, work, env=env)
    if not run.finished:
        raise RuntimeError(f"the job did not finish: {run.failures[-1:]}")
    saves = {}
    for line in (work / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "checkpoint_saved":
            saves[e["iteration"]] = (e["seconds"], e.get("retries", 0))
        elif e["kind"] == "checkpoint_failed":
            saves[e["iteration"]] = (None, e.get("retries", 0))
    records = sum(len(a) for a in run.attempts)
    stamps = [ts for attempt in run.attempts for _it, _loss, ts in attempt]
    return {
        "wall_s": max(stamps) - min(stamps),  # first record to last: setup (process start) left out
        "restarts": len(run.attempts) - 1,
        "steps_lost": records - len(run.merged),
        "saves": saves,
    }


def _fault_figure(fault: str, at: int, runs: list[dict], clean: list[dict]) -> None:
    med = statistics.median
    emit(
        figure="storage_fault",
        fault=fault,
        repeats=len(runs),
        time_lost_s=round(med(r["wall_s"] for r in runs) - med(c["wall_s"] for c in clean), 3),
        retry_s=round(med(r["saves"][at][0] or 0.0 for r in runs) - med(c["saves"][at][0] for c in clean), 3),
        retries=max(r["saves"][at][1] for r in runs),
        saved=all(r["saves"][at][0] is not None for r in runs),
        steps_lost=max(r["steps_lost"] for r in runs),
        restarts=max(r["restarts"] for r in runs),
    )


def storage_faults(workdir: Path, repeats: int, smoke: bool = False) -> None:
    """The storage_fault figures (module docstring)."""
    import boto3

    from bench.checkpoint_io import start_moto
    from tests.faults.matrix import base_spec
    from tests.faults.s3_proxy import FaultProxy

    at = 4
    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    env = {**creds, "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "2", "AWS_RETRY_MODE": "standard"}
    moto, endpoint = start_moto()
    try:
        bucket = "elastron-bench-faults"
        boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id="bench", aws_secret_access_key="bench",
        ).create_bucket(Bucket=bucket)

        def s3_run(name: str, fault: str | None) -> dict:
            # A clean run goes through the proxy too (fault None): the same hop, timed alike.
            with FaultProxy(endpoint, fault, match=f"iter_{at:07d}/") as proxy:
                spec = base_spec(f"s3://{bucket}/{name}", endpoint_url=proxy.url)
                return _fault_run(spec, workdir / name, {**env, "AWS_ENDPOINT_URL": proxy.url})

        if not smoke:
            s3_run("warm-up", None)  # the first run starts the launcher's process server: not counted
        clean = [s3_run(f"clean-{i}", None) for i in range(repeats)]
        # --smoke: one S3 fault (they share every code path here; tests/faults runs each kind)
        for fault in ("s3_503",) if smoke else ("s3_500", "s3_503", "s3_slowdown", "s3_reset"):
            _fault_figure(fault, at, [s3_run(f"{fault}-{i}", fault) for i in range(repeats)], clean)
    finally:
        moto.terminate()
        moto.wait(timeout=30)
    _full_disk(workdir, repeats)


def _full_disk(workdir: Path, repeats: int) -> None:
    """ENOSPC: a tmpfs with room for two checkpoints and a half (keep: 2), so the saves of 6 and
    of 8 each run out of space once, give it back, make room (one commit fewer) and commit."""
    import subprocess

    from tests.faults.matrix import base_spec

    if os.geteuid() != 0 or shutil.which("mount") is None:
        emit(figure="storage_fault", fault="enospc", skipped="needs root and mount(8) for a small tmpfs")
        return
    clean = [_fault_run(base_spec(str(workdir / f"lclean-{i}" / "ckpt")), workdir / f"lclean-{i}") for i in range(repeats)]
    events_file = workdir / "lclean-0" / "events.jsonl"
    size = max(e["bytes"] for e in map(json.loads, events_file.read_text().splitlines()) if e["kind"] == "checkpoint_saved")
    runs = []
    for i in range(repeats):
        small = workdir / f"small-{i}"
        small.mkdir(parents=True)
        room = ((size * 5 // 2) // 4096 + 8) * 4096
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(small)], capture_output=True, text=True)
        if done.returncode != 0:
            emit(figure="storage_fault", fault="enospc", skipped=f"mount failed: {done.stderr.strip()}")
            return
        try:
            runs.append(_fault_run(base_spec(str(small), save_retries=1), workdir / f"enospc-{i}"))
        finally:
            subprocess.run(["umount", str(small)], check=False)
    _fault_figure("enospc", 6, runs, clean)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="recovery measurements")
    parser.add_argument("--rounds", type=int, default=3, help="local/Ray alternations for the overhead")
    parser.add_argument("--iterations", type=int, default=40, help="iterations per overhead run")
    parser.add_argument(
        "--local-interval", type=int, default=1, help="snapshot_overhead: an in-memory snapshot every N steps"
    )
    parser.add_argument(
        "--skip",
        choices=["recovery", "survive", "overhead", "snapshot_overhead", "storage_faults"],
        action="append",
        default=[],
    )
    parser.add_argument(
        "--kill-every", type=float, default=SURVIVE_KILL_EVERY_S, help="mode survive: seconds between kills"
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        action="append",
        default=None,
        help="mode survive: resilience.replica_heartbeat_timeout_ms (repeat it for one survive job each; default the spec's)",
    )
    parser.add_argument(
        "--survive-job",
        choices=["small", "medium"],
        default="small",
        help="mode survive: the SMALL job (~13 ms steps here) or the MEDIUM one (steps ~10x longer)",
    )
    parser.add_argument("--survive-iters", type=int, default=SURVIVE_TRAIN_ITERS, help="mode survive: the job's steps")
    parser.add_argument(
        "--compare-no-relay",
        action="store_true",
        help="mode survive: the same kills again with torchft's Lighthouse alone (no liveness relay)",
    )
    parser.add_argument(
        "--ray-cpus",
        type=int,
        default=2,
        help="CPUs of the local Ray cluster (2: this machine's; a machine with spare cores, e.g. the GPU "
        "machines' 16, shows what the 2-core figures owe to the cores the ranks share with Ray)",
    )
    parser.add_argument("--smoke", action="store_true", help="every figure from tiny runs: a check that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.rounds, args.iterations = 1, 1, WARMUP + 3
    # steady() needs two consecutive iterations after the warm-up.
    if args.iterations < WARMUP + 2 or args.rounds < 1 or args.local_interval < 1:
        parser.error(f"need --iterations >= {WARMUP + 2}, --rounds >= 1, --local-interval >= 1")
    settle_s, train_iters = (SMOKE_SETTLE_S, SMOKE_TRAIN_ITERS) if args.smoke else (SETTLE_S, TRAIN_ITERS)

    if "storage_faults" not in args.skip:  # outside Ray: before the local cluster starts
        with tempfile.TemporaryDirectory(prefix="elastron-bench-faults-") as tmp:
            storage_faults(Path(tmp), args.repeats, smoke=args.smoke)
    receiver = Receiver()
    ray_tmp = tempfile.mkdtemp(prefix="elr-bench-", dir="/tmp")  # a Ray of our own on this machine
    os.environ.update(RAY_TMPDIR=ray_tmp, ELASTRON_API_URL=receiver.url)
    # The local Ray's workers import this checkout too, not whatever elastron the venv installed.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ.pop("ELASTRON_API_TOKEN", None)
    import ray

    with tempfile.TemporaryDirectory(prefix="elastron-bench-recovery-") as tmp:
        os.environ["ELASTRON_SPOOL_DIR"] = str(Path(tmp) / "spool")
        from workers.warm_processes import job_runtime_env

        # As the driver connects for a fast-recovery job (workers/driver.py: _connect).
        ray.init(
            address="local",
            num_cpus=args.ray_cpus,
            include_dashboard=True,
            log_to_driver=False,
            runtime_env=job_runtime_env(),
        )
        try:
            telemetry_cost(receiver, 500 if args.smoke else 20000)
            if "recovery" not in args.skip:
                # --smoke: the memory mode alone, which runs every line of the persistent one
                # too (the persistent resume under it, the restart's breakdown): one Ray job and
                # one restart fewer, ~35 s of the CI's longest test.
                for repeat in range(args.repeats):
                    for mode in ("memory",) if args.smoke else ("persistent", "memory"):
                        recovery(
                            receiver, Path(tmp) / f"recovery-{mode}-{repeat}", repeat, mode, settle_s, train_iters
                        )

            if "survive" not in args.skip:
                for repeat in range(args.repeats):
                    for hb in args.heartbeat_timeout_ms or [None]:
                        survive(
                            receiver,
                            Path(tmp) / f"survive-{repeat}-{hb}",
                            repeat,
                            *(SMOKE_SURVIVE if args.smoke else (args.kill_every, args.survive_iters, None)),
                            heartbeat_timeout_ms=hb,
                            job=args.survive_job,
                            relays=(True, False) if args.compare_no_relay else (True,),
                            reference_run=not args.smoke,
                        )
            plain = None
            if "snapshot_overhead" not in args.skip:
                snapshot_work(2 if args.smoke else 30)
                # statistics.quantiles needs two cycles after the first (skipped).
                snapshot_overhead_interleaved(receiver, Path(tmp) / "snapshots", 3 if args.smoke else 60)
                plain = snapshot_overhead(
                    receiver, Path(tmp) / "snapshots", args.iterations, args.rounds, args.local_interval
                )
            if "overhead" not in args.skip:
                # --smoke: the Ray side is snapshot_overhead's plain run (the same spec), one Ray
                # job fewer; a measurement runs its own, alternating with the local ones.
                overhead(
                    receiver, Path(tmp) / "overhead", args.iterations, args.rounds, plain if args.smoke else None
                )
        finally:
            ray.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
