"""What result validation costs a healthy step: step time with `rerun_mode: validate_results`
against `rerun_mode: disabled`, same job, same ranks, same run (target: ratio <= 1.01).

Validation adds, per step: an RNG snapshot, reading the loss and grad norm on the host (the loop
reads both anyway), and one tiny all-reduce agreeing on "any rank rejected". The two modes are
timed in alternating rounds so machine noise hits both alike; the figure is the ratio of the
medians. On a shared machine that difference is within the noise, so the bench also times the
state machine alone on the same ranks (2,000 healthy steps) and reports its cost relative to the
disabled step time. Prints JSON lines.

    python bench/rerun_overhead.py [--ranks 2] [--rounds 5] [--steps 10] [--smoke]

--smoke: a 2-layer h64 model, 1 round of 1 step, the state machine alone 100 times (seconds;
numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine.launcher import spawn


def _job(mode: str, ranks: int, hidden: int, layers: int) -> dict:
    return {
        "name": f"bench-rerun-{mode}",
        "model": {
            "arch": "llama",
            "num_layers": layers,
            "hidden_size": hidden,
            "num_attention_heads": 8,
            "seq_length": 128,
        },
        "data": {"source": "synthetic"},
        "training": {
            "global_batch_size": 4 * ranks,
            "micro_batch_size": 2,
            "train_iters": 10**6,
            "log_interval": 10**6,
        },
        "resilience": {"rerun_mode": mode},
        "resources": {"ranks": ranks, "device": "cpu"},
    }


def _rank(ranks: int, rounds: int, steps: int, hidden: int, layers: int) -> dict[str, list[float]]:
    """Per mode, every timed step's wall seconds (this rank's view; rank 0's is reported)."""
    from engine import parallel_state as ps
    from engine.jobspec import JobSpec
    from engine.training import Trainer

    times: dict[str, list[float]] = {"disabled": [], "validate_results": []}
    for _ in range(rounds):
        for mode in times:
            trainer = Trainer(JobSpec.model_validate(_job(mode, ranks, hidden, layers)))
            trainer.train_step()  # warm-up: allocations, first-touch of optimizer state
            for _ in range(steps):
                start = time.perf_counter()
                trainer.train_step()
                times[mode].append(time.perf_counter() - start)
            ps.destroy_model_parallel()
    return times


def _machine_cost(iterations: int) -> float:
    """Seconds per step of the state machine alone on a healthy step (the RNG snapshot, two
    validations, the agreement all-reduce), on the real process group: what validate_results
    adds to a step, free of the machine noise that a step-time difference carries."""
    import torch

    from engine.rerun.state_machine import RerunStateMachine, is_nan_or_inf

    rsm = RerunStateMachine("validate_results")
    loss, norm = torch.tensor(2.5), 1.25
    start = time.perf_counter()
    for _ in range(iterations):
        while rsm.should_run_forward_backward(None):
            rsm.validate_result(loss, is_nan_or_inf, "loss is NaN or Inf")
            rsm.validate_result(norm, is_nan_or_inf, "grad norm is NaN or Inf")
        rsm.should_checkpoint_and_exit()
    return (time.perf_counter() - start) / iterations


def _cost_rank(iterations: int) -> float:
    from engine import parallel_state as ps

    ps.initialize_model_parallel()
    try:
        return _machine_cost(iterations)
    finally:
        ps.destroy_model_parallel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 step: checks, not figures")
    args = ap.parse_args()
    iterations = 2000
    if args.smoke:
        args.rounds, args.steps, args.hidden, args.layers, iterations = 1, 1, 64, 2, 100
    times = spawn(
        _rank, args.ranks, (args.ranks, args.rounds, args.steps, args.hidden, args.layers), timeout_s=3600
    )[0]
    off, on = statistics.median(times["disabled"]), statistics.median(times["validate_results"])
    for mode, value in (("disabled", off), ("validate_results", on)):
        print(
            json.dumps(
                {"figure": "step_time_s", "rerun_mode": mode, "median": value, "steps": len(times[mode])}
            )
        )
    cost = statistics.median(
        max(spawn(_cost_rank, args.ranks, (iterations,), timeout_s=600)) for _ in range(3)
    )
    print(
        json.dumps(
            {
                "figure": "state_machine_cost_per_step",
                "seconds": cost,
                "ratio_to_disabled_step": (off + cost) / off,
                "target": "<= 1.01",
            }
        )
    )
    print(
        json.dumps(
            {
                "figure": "validate_results_over_disabled",
                "ratio": on / off,
                "target": "<= 1.01",
                "ranks": args.ranks,
                "hidden": args.hidden,
                "layers": args.layers,
            }
        )
    )


if __name__ == "__main__":
    main()
