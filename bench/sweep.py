"""What early stopping saves a sweep: ASHA (Optuna's successive halving) against random search
with the same trials, in GPU-hours, on a simulated clock.

Each trial is a job of TRIAL_GPUS GPUs admitted by the service's scheduler core
(service/scheduling/decision.py, the function the reconciler calls) on a cluster of NODES nodes,
at most `max_parallel` trials queued or running at once (the sweep's own cap). Trials are drawn by
the service's study (service/sweeps/study.py: Optuna's random sampler, the same seed in both runs,
so both searches see the same configurations in the same order) and report a known loss curve at
every iteration; the ASHA run's pruner stops a trial at a rung, after which it runs to its next
checkpoint (every CHECKPOINT_EVERY iterations) as a real pruned trial does before it stops.

The curves cross, as real ones do: a larger learning rate learns faster early and ends higher,
so a pruner can stop the configuration that would have won. `loss(t) = q + (L0 - q) (1 + t/tau)^-0.7`
with the final loss q smallest at lr = 10^-3.2 and batch 32, and tau (iterations to learn) falling
with the learning rate. The figure is ASHA's GPU-hours over random search's, and whether ASHA's best
trial is the configuration random search finds best (`same_best`, and `regret`: the difference of
their final losses), over `--seeds` sweeps.

    python bench/sweep.py [--trials 27] [--iters 81] [--max-parallel 4] [--seeds 5] [--smoke]

--smoke: 9 trials of 27 iterations, one seed (seconds; the figures are a check, not a result).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
from dataclasses import dataclass

import optuna

from service.scheduling.decision import decide
from service.scheduling.model import Job, Node, Running, Shape
from service.sweeps.spec import SweepSpec
from service.sweeps.study import SweepStudy

NODES, GPUS_PER_NODE, CPUS_PER_NODE = 4, 2, 16
TRIAL_GPUS = 2
RANK = Shape(cpus=1, gpus=1)
STEP_S = 60.0  # one iteration of a trial, on its GPUs
CHECKPOINT_EVERY = 3
L0 = 6.0
BATCHES = [16, 32, 64]


def final_loss(lr: float, batch: int) -> float:
    return 2.0 + 0.25 * (math.log10(lr) + 3.2) ** 2 + 0.05 * math.log2(batch / 32) ** 2


def loss_at(lr: float, batch: int, t: int) -> float:
    tau = 10 ** (-math.log10(lr) - 2.0) * (batch / 32)  # lr 1e-2: ~1 iteration; 1e-5: ~1,000
    q = final_loss(lr, batch)
    return q + (L0 - q) * (1 + t / tau) ** -0.7


@dataclass
class Trial:
    number: int
    lr: float
    batch: int
    iteration: int = 0
    stop_at: int | None = None  # pruned: the checkpoint it stops at


def sweep_spec(trials: int, iters: int, max_parallel: int, seed: int, pruner: str, min_resource: int) -> SweepSpec:
    return SweepSpec.model_validate(
        {
            "base": {"training": {"train_iters": iters, "global_batch_size": 32, "micro_batch_size": 1}},
            "search_space": {
                "optimizer.lr": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True},
                "training.global_batch_size": {"type": "choice", "values": BATCHES},
            },
            "metric": {"name": "loss"},
            "budget": {"max_trials": trials, "max_parallel": max_parallel},
            "sampler": {"name": "random", "seed": seed},
            "pruner": {"name": pruner, "min_resource": min_resource, "reduction_factor": 3},
        }
    )


def run_sweep(spec: SweepSpec, iters: int) -> dict:
    """One sweep on the simulated cluster: GPU-hours used, makespan, the best trial."""
    study = SweepStudy.open(spec, "bench", optuna.storages.InMemoryStorage(), iters)
    nodes = [Node(f"node{i}", CPUS_PER_NODE, GPUS_PER_NODE) for i in range(NODES)]
    budget = spec.budget
    trials: dict[str, Trial] = {}
    queued: dict[str, Job] = {}
    running: dict[str, Running] = {}
    events: list[tuple[float, str]] = []  # (time an iteration ends, trial)
    now, asked, gpu_s = 0.0, 0, 0.0
    finals: dict[int, float] = {}

    def schedule() -> None:
        nonlocal asked
        while asked < budget.max_trials and len(queued) + len(running) < budget.max_parallel:
            number, values = study.ask()
            tid = f"trial{number}"
            trials[tid] = Trial(number, values["optimizer.lr"], values["training.global_batch_size"])
            queued[tid] = Job(tid, "sweeper", RANK, TRIAL_GPUS, submitted_at=now)
            asked += 1
        decision = decide(nodes, list(running.values()), list(queued.values()), {}, now)
        for a in decision.admit:
            running[a.job_id] = Running(queued.pop(a.job_id), a.placement)
            heapq.heappush(events, (now + STEP_S, a.job_id))

    schedule()
    while events:
        now, tid = heapq.heappop(events)
        trial = trials[tid]
        trial.iteration += 1
        gpu_s += STEP_S * TRIAL_GPUS
        loss = loss_at(trial.lr, trial.batch, trial.iteration)
        if trial.stop_at is None and study.report(trial.number, trial.iteration, loss):
            trial.stop_at = -(-trial.iteration // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
        ended = trial.iteration >= (trial.stop_at or iters)
        if not ended:
            heapq.heappush(events, (now + STEP_S, tid))
            continue
        del running[tid]
        if trial.stop_at is not None:
            study.pruned(trial.number)
        else:
            study.complete(trial.number, loss)
            finals[trial.number] = loss
        schedule()
    best = study.best()
    pruned = sum(1 for s in study.states().values() if s == "pruned")
    return {
        "gpu_hours": gpu_s / 3600,
        "makespan_h": now / 3600,
        "best": best,
        "best_final_loss": best.value if best else None,
        "pruned": pruned,
        "trials": asked,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=27)
    ap.add_argument("--iters", type=int, default=81)
    ap.add_argument("--max-parallel", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--min-resource", type=int, default=9, help="ASHA: iterations before the first rung")
    ap.add_argument("--smoke", action="store_true", help="9 trials of 27 iterations, one seed")
    args = ap.parse_args()
    if args.smoke:
        args.trials, args.iters, args.seeds = 9, 27, 1
    ratios, same, regrets = [], 0, []
    for seed in range(args.seeds):
        runs = {
            name: run_sweep(sweep_spec(args.trials, args.iters, args.max_parallel, seed, pruner, args.min_resource), args.iters)
            for name, pruner in (("random", "none"), ("asha", "asha"))
        }
        random_run, asha = runs["random"], runs["asha"]
        if random_run["best"] is None or asha["best"] is None:
            raise SystemExit(f"seed {seed}: a sweep ended without a complete trial: {runs}")
        ratio = asha["gpu_hours"] / random_run["gpu_hours"]
        is_same = asha["best"].params == random_run["best"].params
        regret = asha["best_final_loss"] - random_run["best_final_loss"]
        ratios.append(ratio)
        same += is_same
        regrets.append(regret)
        for name, r in runs.items():
            line = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "best"}
            print(json.dumps({"bench": "sweep", "search": name, "seed": seed, "smoke": args.smoke, **line}))
        print(
            json.dumps(
                {
                    "bench": "sweep",
                    "seed": seed,
                    "figure": "asha_over_random_gpu_hours",
                    "value": round(ratio, 4),
                    "same_best": is_same,
                    "regret": round(regret, 5),
                    "smoke": args.smoke,
                }
            ),
            flush=True,
        )
    print(
        json.dumps(
            {
                "bench": "sweep",
                "summary": True,
                "trials": args.trials,
                "iters": args.iters,
                "max_parallel": args.max_parallel,
                "seeds": args.seeds,
                "asha_over_random_gpu_hours_median": round(statistics.median(ratios), 4),
                "same_best_share": round(same / args.seeds, 3),
                "regret_max": round(max(regrets), 5),
                "target": "<= 0.333 of random search's GPU-hours, same best configuration",
                "smoke": args.smoke,
            }
        )
    )


if __name__ == "__main__":
    main()
