"""What `resilience.lost_replica_share` costs a step, measured on the process, without Ray: two
data-parallel replicas (each one rank on gloo, in a process of its own; torchft's Lighthouse
with its liveness relay in this process), trained with `skip` and with `redistribute` in
alternating rounds of one run, so machine noise hits both alike.

- `whole`: both replicas in every quorum. `redistribute` waits for each step's quorum before
  the forward, where `skip` agrees it beside the forward and backward: the ratio is what every
  step of a `redistribute` job pays while nothing is missing.
- `alone`: after replica 1 is released at a step boundary (RankHooks.should_leave, as a live
  shrink does) the survivor trains on. `skip` trains its own share of each batch, `redistribute`
  its own and the released replica's (the uninterrupted run's samples): the ratio, about the
  replicas over the survivors (2 here), is the price of keeping the uninterrupted run's math.

Prints JSON lines: one per mode and phase (median step seconds over the rounds' timed steps),
then the two ratios redistribute/skip.

    python bench/replica_share.py [--steps 40] [--rounds 2] [--hidden 256] [--smoke]

--smoke: 2-layer h64 model, 12 steps, one round (seconds; numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
from pathlib import Path

MODES = ("skip", "redistribute")
WARMUP = 3  # steps after a start or a release whose times are left out (allocations, the first quorum)


def _spec(mode: str, steps: int, hidden: int, layers: int) -> dict:
    return {
        "name": f"bench-share-{mode}",
        "model": {"arch": "llama", "num_layers": layers, "hidden_size": hidden, "num_attention_heads": 4, "seq_length": 128},
        "data": {"source": "synthetic"},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "train_iters": steps, "log_interval": 10**6, "seed": 3},
        "resilience": {"on_rank_failure": "replace_replica", "lost_replica_share": mode},
        "resources": {"ranks": 1, "device": "cpu"},
    }


def _run_replica(index: int, spec: dict, lighthouse: tuple[str, str], out: str, leave_at: int | None) -> None:
    """Replica `index` of two: its step records to `out` (one JSON line each); released once it
    has reported iteration `leave_at`."""
    import torch
    import torch.distributed as dist

    from engine.fault_tolerance.replica_quorum import ReplicaQuorum
    from engine.launcher import free_port
    from engine.rank_hooks import RankHooks
    from engine.train_loop import train_rank

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    quorum = ReplicaQuorum(
        index,
        2,
        lighthouse_addr=lighthouse[0],
        liveness_addr=lighthouse[1],
        redistribute=spec["resilience"]["lost_replica_share"] == "redistribute",
    )
    released: list[int] = []
    with open(out, "w") as sink:

        def on_record(r: dict) -> None:
            sink.write(json.dumps({k: r[k] for k in ("iteration", "replicas", "step_time_s")}) + "\n")
            if r["iteration"] == leave_at:
                released.append(r["iteration"])

        hooks = RankHooks(on_record=on_record, quorum=quorum, should_leave=lambda: bool(released))
        train_rank(spec, quiet=True, hooks=hooks)


def _one_run(mode: str, steps: int, hidden: int, layers: int, folder: Path) -> dict[str, list[float]]:
    """Both replicas, replica 1 released halfway: the survivor's step seconds per phase."""
    from engine.fault_tolerance.lighthouse import Lighthouse

    lighthouse = Lighthouse(silent_timeout_ms=500)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "engine.device", "engine.train_loop"])
    spec, leave_at = _spec(mode, steps, hidden, layers), steps // 2
    outs = [folder / f"{mode}-{i}.jsonl" for i in range(2)]
    addresses = (lighthouse.address(), lighthouse.liveness_address())
    procs = [
        ctx.Process(target=_run_replica, args=(i, spec, addresses, str(outs[i]), leave_at if i == 1 else None))
        for i in range(2)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{mode}: a replica exited {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    records = [json.loads(line) for line in outs[0].read_text().splitlines()]
    left = min(r["iteration"] for r in records if r["replicas"] == 1)
    return {
        "whole": [r["step_time_s"] for r in records if r["replicas"] == 2 and WARMUP < r["iteration"] < leave_at],
        "alone": [r["step_time_s"] for r in records if r["replicas"] == 1 and r["iteration"] >= left + WARMUP],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.steps, a.rounds, a.hidden, a.layers = 12 + 2 * WARMUP, 1, 64, 2
    times = {(m, phase): [] for m in MODES for phase in ("whole", "alone")}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.rounds):
            for mode in MODES:
                for phase, seconds in _one_run(mode, a.steps, a.hidden, a.layers, Path(tmp)).items():
                    times[(mode, phase)] += seconds
    median = {key: statistics.median(v) for key, v in times.items()}
    for (mode, phase), value in median.items():
        print(json.dumps({"figure": "step_s", "mode": mode, "phase": phase, "median": round(value, 5),
                          "steps": len(times[(mode, phase)]), "hidden": a.hidden, "smoke": a.smoke}))  # fmt: skip
    for phase, what in (("whole", "redistribute_over_skip_whole"), ("alone", "redistribute_over_skip_alone")):
        ratio = median[("redistribute", phase)] / median[("skip", phase)]
        print(json.dumps({"figure": what, "ratio": round(ratio, 3), "smoke": a.smoke}))


if __name__ == "__main__":
    main()
