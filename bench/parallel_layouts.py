"""Tokens/s of each parallel layout on 4 CPU ranks relative to the 1-rank run of the same model
on the same global batch, measured in the same command. Prints one JSON line per layout.

Also the share of the step spent in the phases the engine times separately: `grads-finalize`
(waiting for data-parallel reductions not hidden behind backward, SP/embedding grad sums) and
`optimizer` (including the distributed optimizer's all-gather). TP and PP communication happens
inside forward-backward and is not separated here.

This is a 2-core machine running 4 ranks: look for anomalies (a layout far slower than its
peers), not records. The ideal on 2 cores is a ratio near 1.0 (same work, same cores). The
4-rank layouts run one after another in the same 4 processes (a fresh trainer each).

    python bench/parallel_layouts.py [--steps 6] [--smoke]

--smoke: every layout on a 4-layer h64 s32 model, 1 timed step each (seconds; numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import statistics

from engine import parallel_state as ps
from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.training import Trainer

MODEL = {"arch": "llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128}
SMOKE_MODEL = {**MODEL, "hidden_size": 64, "seq_length": 32}
LAYOUTS = {
    "1 rank (reference)": (1, {}),
    "dp4": (4, {}),
    "dp4 distributed optimizer": (4, {"distributed_optimizer": True}),
    "tp2 dp2": (4, {"tensor": 2}),
    "tp4": (4, {"tensor": 4}),
    "tp4 sp": (4, {"tensor": 4, "sequence_parallel": True}),
    "pp2 dp2 1f1b": (4, {"pipeline": 2}),
    "pp4 1f1b": (4, {"pipeline": 4}),
    "pp2 vp2 dp2 interleaved": (4, {"pipeline": 2, "virtual_pipeline": 2}),
    "tp2 pp2": (4, {"tensor": 2, "pipeline": 2}),
    "tp2 pp2 sp full-recompute": (4, {"tensor": 2, "pipeline": 2, "sequence_parallel": True}),
}


def _run(specs: list[dict], steps: int) -> list[dict]:
    out = []
    for spec_dict in specs:
        trainer = Trainer(JobSpec.model_validate(spec_dict))
        trainer.train_step()  # warm-up: allocations, pipeline shape inference
        records = [trainer.train_step() for _ in range(steps)]
        out.append(
            {
                "step_s": statistics.median(r.step_time_s for r in records),
                "tokens": records[0].tokens,
                "timers": records[-1].timers,
            }
        )
        ps.destroy_model_parallel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 step per layout: checks, not figures")
    args = ap.parse_args()
    if args.smoke:
        args.steps = 1
    specs = {}
    for name, (ranks, parallel) in LAYOUTS.items():
        specs[name] = {
            "name": "bench-layouts",
            "model": SMOKE_MODEL if args.smoke else MODEL,
            "parallel": parallel,
            "data": {"source": "synthetic"},
            "training": {
                "global_batch_size": 16,
                "micro_batch_size": 2,
                "train_iters": args.steps + 1,
                "log_interval": 1,
                "recompute": "full" if "recompute" in name else "none",
            },
            "resources": {"ranks": ranks, "device": "cpu"},
        }
    results = {}
    for ranks in sorted({r for r, _ in LAYOUTS.values()}):
        names = [name for name, (r, _) in LAYOUTS.items() if r == ranks]
        outs = spawn(_run, ranks, ([specs[n] for n in names], args.steps), timeout_s=3600)[0]
        results.update(zip(names, outs, strict=True))
    base = None
    for name, (ranks, _) in LAYOUTS.items():
        out = results[name]
        tokens_per_s = out["tokens"] / out["step_s"]
        base = base or tokens_per_s
        share = {
            k: round(v[1] / out["step_s"], 3) for k, v in out["timers"].items() if k != "forward-backward"
        }
        print(
            json.dumps(
                {
                    "bench": "parallel_layouts",
                    "layout": name,
                    "ranks": ranks,
                    "tokens_per_s": round(tokens_per_s),
                    "ratio_vs_1_rank": round(tokens_per_s / base, 3),
                    "step_s": round(out["step_s"], 3),
                    "max_share_of_step": share,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
