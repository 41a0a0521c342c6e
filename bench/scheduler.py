"""The scheduler on a day of a 1,024-GPU cluster: a seeded synthetic trace replayed on a simulated
clock through the service's pure decision (service/scheduling/decision.py, the function the
reconciler calls), against plain FIFO and against greedy first fit (today's behaviour: every job handed to
Ray at once, which places whatever fits) in the same run.

The trace's shape follows the published GPU-cluster traces, Microsoft's Philly (Jeon et al.,
ATC'19) and SenseTime's Helios (Hu et al., SC'21): most jobs take one GPU, a long tail takes
many (here up to 512), and run times are heavy-tailed. The exact mix below is ours, not theirs:
GPUs per job 1 (70 %), 2 (7 %), 4 (8 %), 8 (8 %), 16-512 (7 %, halving per doubling); run time
log-normal, median 30 min, sigma 1.5, clipped to [1 min, 3 days]; Poisson arrivals at 1.2x the
cluster's capacity over 24 h; priorities 0 / 5 / 10 (75 / 20 / 5 %); 10 tenants (Zipf); 90 %
preemptible; 30 % of the jobs of >= 4 GPUs elastic down to half. A preemption or shrink costs a
checkpoint (120 s, the job holding its room) and a restart (120 s without progress). The same
trace is replayed once more with the elastic jobs resized as `resilience.resize: live` does
(`elastron_live_resize`: a shrink or grow costs only the released or added ranks LIVE_RESIZE_S,
bench/recovery.py's measured resize_s; the others train on); the summary says how many fewer
GPU-hours it loses (target >= 5x) and its priority-10 p99 wait (target <= 120 s).

Prints one JSON line per policy and a summary line: GPU utilisation while the queue is not
empty, p50/p99 wait per priority, preemptions, GPU-hours lost to them, and the time of one
decision with 10,000 jobs queued (targets: utilisation >= 90 %, priority-10 p99 wait <= one
checkpoint, a decision <= 50 ms).

    python bench/scheduler.py [--gpus 1024] [--hours 24] [--load 1.2] [--seed 0] [--smoke]

--smoke: 64 GPUs, 4 hours at 3x load, a decision over 1,000 queued jobs (seconds; numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from service.scheduling.decision import decide
from service.scheduling.model import Job, Node, Policy, Running, Shape
from service.scheduling.simulate import Simulation, TraceJob

GPUS_PER_NODE, CPUS_PER_NODE = 8, 96
RANK = Shape(cpus=8, gpus=1)
SIZES = [(1, 0.70), (2, 0.07), (4, 0.08), (8, 0.08)] + [(16 << i, 0.07 * 0.5 ** (i + 1) / (1 - 0.5**6)) for i in range(6)]
PRIORITIES = [(0, 0.75), (5, 0.20), (10, 0.05)]
CHECKPOINT_S = RESTART_S = 120.0
# resilience.resize: live: a shrink or grow of an elastic job, request to stepping at the new size,
# measured by bench/recovery.py's resize mode (1.05 s and 1.90 s on a 2-core machine), rounded up.
LIVE_RESIZE_S = 2.0
POLICIES = {
    "elastron": Policy(),
    "fifo": Policy(order="fifo", backfill=False, preemption=False, grow=False),
    "first_fit": Policy(order="fifo", reserve=False, preemption=False, grow=False),
}


def _pick(rng: random.Random, table):
    x, acc = rng.random(), 0.0
    for value, p in table:
        acc += p
        if x < acc:
            return value
    return table[-1][0]


def make_trace(gpus: int, hours: float, load: float, seed: int) -> list[TraceJob]:
    rng = random.Random(seed)
    largest = max(s for s, _ in SIZES if s <= gpus)
    sizes = [(s, p) for s, p in SIZES if s <= largest]
    mean_gpus = sum(s * p for s, p in sizes) / sum(p for _, p in sizes)
    median_s, sigma = 1800.0, 1.5
    mean_s = median_s * math.exp(sigma**2 / 2)
    window = hours * 3600
    rate = load * gpus / (mean_gpus * mean_s)  # jobs per second
    tenants = [f"tenant{i}" for i in range(10)]
    weights = [1 / (i + 1) for i in range(10)]
    trace, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t > window:
            return trace
        size = _pick(rng, sizes)
        elastic = size >= 4 and rng.random() < 0.3
        job = Job(
            f"job{i}",
            rng.choices(tenants, weights)[0],
            RANK,
            size,
            priority=_pick(rng, PRIORITIES),
            submitted_at=t,
            min_ranks=size // 2 if elastic else None,
            preemptible=rng.random() < 0.9,
        )
        work = min(max(rng.lognormvariate(math.log(median_s), sigma), 60.0), 3 * 86400.0)
        trace.append(TraceJob(job, work))
        i += 1


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def replay(name: str, nodes: list[Node], trace: list[TraceJob], live: bool = False) -> dict:
    """One policy over the trace; `live`: its elastic jobs resize as `resilience.resize: live` does."""
    start = time.perf_counter()
    result = Simulation(
        nodes,
        policy=POLICIES[name],
        checkpoint_s=CHECKPOINT_S,
        restart_s=RESTART_S,
        live_resize_s=LIVE_RESIZE_S if live else None,
    ).run(trace)
    waits: dict[int, list[float]] = {}
    for o in result.outcomes.values():
        if o.admitted_at is not None:
            waits.setdefault(o.job.priority, []).append(o.admitted_at - o.job.submitted_at)
    unfinished = sum(1 for o in result.outcomes.values() if o.finished_at is None and not o.refused)
    return {
        "policy": name + ("_live_resize" if live else ""),
        "jobs": len(trace),
        "unfinished": unfinished,
        "utilisation_while_queued": round(result.utilisation, 4),
        "wait_s": {
            str(p): {"p50": _pct(w, 0.5), "p99": _pct(w, 0.99), "n": len(w)} for p, w in sorted(waits.items())
        },
        "preemptions": sum(o.preemptions for o in result.outcomes.values()),
        "resizes": sum(o.resizes for o in result.outcomes.values()),
        "gpu_hours_lost": round(result.lost_gpu_s / 3600, 1),
        "gpu_hours_lost_to_resizes": round(result.lost_resize_gpu_s / 3600, 1),
        "decisions": result.decisions,
        "simulated_hours": round(result.end / 3600, 1),
        "replay_s": round(time.perf_counter() - start, 1),
    }


def decision_time(nodes: list[Node], queued: int, seed: int) -> float:
    """Median seconds of one decision on a full cluster with `queued` jobs waiting."""
    rng = random.Random(seed)
    trace = make_trace(len(nodes) * GPUS_PER_NODE, 10_000, 1.0, seed)
    running, k = [], 0
    for node in nodes:
        for _ in range(GPUS_PER_NODE):
            job = Job(f"run{k}", f"tenant{k % 10}", RANK, 1, priority=rng.choice([0, 5]), preemptible=False)
            running.append(Running(job, {node.id: 1}))
            k += 1
    waiting = [t.job for t in trace[:queued]]
    now = max(j.submitted_at for j in waiting) + 1
    times = []
    for _ in range(5):
        start = time.perf_counter()
        decide(nodes, running, waiting, {}, now)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--load", type=float, default=1.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--queued", type=int, default=10_000, help="queue length for the decision time")
    ap.add_argument("--smoke", action="store_true", help="tiny cluster and trace: checks, not figures")
    args = ap.parse_args()
    if args.smoke:
        args.gpus, args.hours, args.queued, args.load = 64, 4.0, 1_000, 3.0
    nodes = [Node(f"node{i}", CPUS_PER_NODE, GPUS_PER_NODE) for i in range(args.gpus // GPUS_PER_NODE)]
    trace = make_trace(args.gpus, args.hours, args.load, args.seed)
    results = {name: replay(name, nodes, trace) for name in POLICIES}
    results["elastron_live_resize"] = replay("elastron", nodes, trace, live=True)
    for r in results.values():
        if r["unfinished"]:
            raise SystemExit(f"{r['policy']}: {r['unfinished']} jobs never finished: the simulation is wrong")
        print(json.dumps({"bench": "scheduler", "smoke": args.smoke, **r}), flush=True)
    ours, fifo, live = results["elastron"], results["fifo"], results["elastron_live_resize"]

    def p99(r, p):
        return (r["wait_s"].get(str(p)) or {}).get("p99")

    summary = {
        "bench": "scheduler",
        "summary": True,
        "smoke": args.smoke,
        "gpus": args.gpus,
        "jobs": len(trace),
        "utilisation": ours["utilisation_while_queued"],
        "utilisation_vs_fifo": round(ours["utilisation_while_queued"] / max(fifo["utilisation_while_queued"], 1e-9), 3),
        "utilisation_vs_first_fit": round(
            ours["utilisation_while_queued"] / max(results["first_fit"]["utilisation_while_queued"], 1e-9), 3
        ),
        "p99_wait_priority10_s": p99(ours, 10),
        "p99_wait_priority10_vs_fifo": (
            round(p99(ours, 10) / max(p99(fifo, 10), 1e-9), 4) if p99(ours, 10) is not None and p99(fifo, 10) else None
        ),
        "checkpoint_s": CHECKPOINT_S,
        "gpu_hours_lost_to_preemption": ours["gpu_hours_lost"],
        # the same trace with the elastic jobs resized live (resilience.resize: live)
        "live_resize_s": LIVE_RESIZE_S,
        "gpu_hours_lost_with_live_resize": live["gpu_hours_lost"],
        "gpu_hours_lost_restart_over_live": round(ours["gpu_hours_lost"] / max(live["gpu_hours_lost"], 1e-9), 2),
        "p99_wait_priority10_s_with_live_resize": p99(live, 10),
        "decision_ms_at_queued": {str(args.queued): round(1000 * decision_time(nodes, args.queued, args.seed), 2)},
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
