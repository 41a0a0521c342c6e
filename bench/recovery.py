"""Recovery and overhead of jobs on Ray (workers/), against references in the same process.

Figures (one JSON line each), one module of bench/recovery_modes/ per mode, whose docstring says
what each figure measures and against what:

- recovery (sigkill_recovery.py): a rank SIGKILLed mid-interval -> the first step after the
  resume, with persistent checkpoints only and with in-memory ones too, over the job's cold start.
- survive (replica_kills.py): replica 1 killed every `--kill-every` seconds under
  `replace_replica`: the survivors' stall, the rejoin, the throughput kept against the same job
  without kills, where the machine's CPU went (cpu_ledger.py).
- snapshot_overhead, snapshot_overhead_interleaved, snapshot_work_ratio (snapshot_overhead.py):
  what in-memory snapshots add to a step, against the same job without them.
- overhead (ray_overhead.py): the step on Ray over the same step under the engine's local launcher.
- launch (launch_prestart.py): a 2-rank job's launch -> its ranks up and its first step, with the
  ranks' processes asked for ahead by the driver against Ray Train starting them.
- telemetry (telemetry_cost.py): one per-step `TelemetrySender.record()` call.
- storage_fault (storage_faults.py): an S3 fault or a full disk during a save, against a clean run.
- resize (live_resize.py): `resize_s`, a shrink 2 -> 1 replica groups and the grow back, from the
  control plane's request to the first step at the new size, with `resilience.resize: live`
  against the restart-based resize of the same job.

What they share (the jobs, the local Ray cluster and its telemetry receiver, the JSON lines):
harness.py.

    python bench/recovery.py [--repeats 1] [--rounds 3] [--iterations 40]
        [--skip MODE ...] [--only MODE ...]   MODE: recovery|survive|overhead|snapshot_overhead|storage_faults|launch|resize
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
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODES = ("recovery", "survive", "overhead", "snapshot_overhead", "storage_faults", "launch", "resize")


def main() -> None:
    # Imported here, once ROOT is on sys.path (run as a script, only bench/ itself is).
    from bench.recovery_modes.harness import WARMUP, local_ray
    from bench.recovery_modes.launch_prestart import launch
    from bench.recovery_modes.live_resize import live_resize
    from bench.recovery_modes.ray_overhead import overhead
    from bench.recovery_modes.replica_kills import (
        SMOKE_SURVIVE,
        SURVIVE_KILL_EVERY_S,
        SURVIVE_TRAIN_ITERS,
        survive,
    )
    from bench.recovery_modes.sigkill_recovery import (
        SETTLE_S,
        SMOKE_SETTLE_S,
        SMOKE_TRAIN_ITERS,
        TRAIN_ITERS,
        recovery,
    )
    from bench.recovery_modes.snapshot_overhead import (
        snapshot_overhead,
        snapshot_overhead_interleaved,
        snapshot_work,
    )
    from bench.recovery_modes.storage_faults import storage_faults
    from bench.recovery_modes.telemetry_cost import telemetry_cost

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="recovery measurements")
    parser.add_argument(
        "--rounds", type=int, default=3, help="local/Ray alternations for the overhead, launches each way for launch"
    )
    parser.add_argument("--iterations", type=int, default=40, help="iterations per overhead run")
    parser.add_argument(
        "--local-interval", type=int, default=1, help="snapshot_overhead: an in-memory snapshot every N steps"
    )
    parser.add_argument("--skip", choices=MODES, action="append", default=[], help="leave this mode out")
    parser.add_argument(
        "--only",
        choices=MODES,
        action="append",
        default=[],
        help="run this mode (repeat it for several) and leave the others out: tests/test_bench_smoke.py "
        "smokes the bench in parts, each under its own time limit",
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
    if args.only:
        args.skip = sorted(set(args.skip) | (set(MODES) - set(args.only)))
    if args.smoke:
        args.repeats, args.rounds, args.iterations = 1, 1, WARMUP + 3
    # steady() needs two consecutive iterations after the warm-up.
    if args.iterations < WARMUP + 2 or args.rounds < 1 or args.local_interval < 1:
        parser.error(f"need --iterations >= {WARMUP + 2}, --rounds >= 1, --local-interval >= 1")
    settle_s, train_iters = (SMOKE_SETTLE_S, SMOKE_TRAIN_ITERS) if args.smoke else (SETTLE_S, TRAIN_ITERS)

    if "storage_faults" not in args.skip:  # outside Ray: before the local cluster starts
        with tempfile.TemporaryDirectory(prefix="elastron-bench-faults-") as tmp:
            storage_faults(Path(tmp), args.repeats, smoke=args.smoke)
    if set(MODES) - {"storage_faults"} <= set(args.skip):
        return  # nothing left that needs the Ray cluster
    with local_ray(args.ray_cpus) as (receiver, tmp):
        telemetry_cost(receiver, 500 if args.smoke else 20000)
        if "launch" not in args.skip:  # first: no other job's processes about
            launch(receiver, tmp / "launch", args.rounds, iters=4 if args.smoke else 20)
        if "resize" not in args.skip:
            live_resize(receiver, tmp / "resize", smoke=args.smoke)
        if "recovery" not in args.skip:
            # --smoke: the memory mode alone, which runs every line of the persistent one
            # too (the persistent resume under it, the restart's breakdown): one Ray job and
            # one restart fewer, ~35 s of the CI's longest test.
            for repeat in range(args.repeats):
                for mode in ("memory",) if args.smoke else ("persistent", "memory"):
                    recovery(
                        receiver, tmp / f"recovery-{mode}-{repeat}", repeat, mode, settle_s, train_iters
                    )

        if "survive" not in args.skip:
            for repeat in range(args.repeats):
                for hb in args.heartbeat_timeout_ms or [None]:
                    survive(
                        receiver,
                        tmp / f"survive-{repeat}-{hb}",
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
            snapshot_overhead_interleaved(receiver, tmp / "snapshots", 3 if args.smoke else 60)
            plain = snapshot_overhead(
                receiver, tmp / "snapshots", args.iterations, args.rounds, args.local_interval
            )
        if "overhead" not in args.skip:
            # --smoke: the Ray side is snapshot_overhead's plain run (the same spec), one Ray
            # job fewer; a measurement runs its own, alternating with the local ones.
            overhead(
                receiver, tmp / "overhead", args.iterations, args.rounds, plain if args.smoke else None
            )


if __name__ == "__main__":
    main()
