"""Tokens/s of context parallelism (CP=2, ring attention) against one rank (CP=1) on the same
long-sequence job and the same cores, measured in the same command. Prints one JSON line per
sequence length and layout.

CP=2 runs two ranks that each hold half of every sequence (two of four chunks) and pass K/V
blocks around the ring; CP=1 runs one rank with torch's fused causal attention on the whole
sequence. On this 2-core machine both use the same two cores (one thread per rank for CP=2),
so the ideal ratio is about 1.0: what CP buys on CPU is memory per rank (activations halve,
reported as max_rss_mib), at the cost of the ring's block-wise attention and its messages.
Attention dominates at these lengths, which is where CP matters.

The layouts are run in alternating rounds and the median step is reported, with the 1-minute
load average: on a shared machine a 2-thread rank (CP=1) suffers much more from other processes
than two 1-thread ranks do, so a third row runs CP=1 on one thread (one core: the ideal CP=2 ratio
against it is 2.0), which shows what the ring costs per core against the fused attention kernel.

    python bench/context_parallel.py [--seq 4096 8192] [--steps 2] [--rounds 2] [--smoke]

--smoke: every layout at sequence length 128, 1 step, 1 round (seconds; numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics

import torch

from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.training import Trainer

# name -> (context, threads per rank; None: the launcher's split of the cores)
LAYOUTS = {
    "cp1": (1, None),
    "cp2": (2, None),
    "cp1-one-thread": (1, 1),
}


def _job(seq: int, context: int, steps: int) -> dict:
    return {
        "name": "bench-context-parallel",
        "model": {
            "arch": "llama",
            "num_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 8,
            "num_query_groups": 4,
            "seq_length": seq,
        },
        "parallel": {"context": context},
        "data": {"source": "synthetic"},
        "training": {
            "global_batch_size": 2,
            "micro_batch_size": 1,
            "train_iters": steps + 1,
            "log_interval": 10**6,
        },
        "resources": {"ranks": context, "device": "cpu"},
    }


def _run(spec_dict: dict, steps: int, threads: int | None) -> dict:
    if threads is not None:
        torch.set_num_threads(threads)
    trainer = Trainer(JobSpec.model_validate(spec_dict))
    trainer.train_step()  # warm-up: allocations, first touch of optimizer state
    records = [trainer.train_step() for _ in range(steps)]
    return {
        "step_s": statistics.median(r.step_time_s for r in records),
        "tokens": records[0].tokens,
        "loss": records[-1].loss,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[4096])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternating CP=1 / CP=2 runs; medians reported")
    ap.add_argument("--smoke", action="store_true", help="seq 128, 1 step, 1 round: checks, not figures")
    args = ap.parse_args()
    if args.smoke:
        args.seq, args.steps, args.rounds = [128], 1, 1
    for seq in args.seq:
        runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
        for _ in range(args.rounds):  # alternate, so drifting machine load hits every layout alike
            for name, (context, threads) in LAYOUTS.items():
                job = _job(seq, context, args.steps)
                runs[name].append(spawn(_run, context, (job, args.steps, threads), timeout_s=1800))
        base = None
        for name, outs in runs.items():
            step_s = statistics.median(o[0]["step_s"] for o in outs)
            tokens_per_s = outs[0][0]["tokens"] / step_s
            base = base or tokens_per_s
            print(
                json.dumps(
                    {
                        "bench": "context_parallel",
                        "layout": name,
                        "seq_length": seq,
                        "context": LAYOUTS[name][0],
                        "threads_per_rank": outs[0][0]["threads"],
                        "tokens_per_s": round(tokens_per_s),
                        "ratio_vs_cp1": round(tokens_per_s / base, 3),
                        "step_s": round(step_s, 3),
                        "step_s_per_round": [round(o[0]["step_s"], 3) for o in outs],
                        "max_rss_mib": round(max(r["max_rss_mib"] for o in outs for r in o)),
                        "loss": round(outs[0][0]["loss"], 4),
                        "load_avg_1m": round(os.getloadavg()[0], 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
