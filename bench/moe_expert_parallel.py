"""Expert parallelism on CPU ranks: tokens/s of EP=2 against EP=1 (every expert replicated on
both data-parallel ranks) for the same MoE model, and the share of the step spent in the token
all-to-alls. Both layouts run on the same 2 ranks in alternating rounds; medians. JSON lines.

    python bench/moe_expert_parallel.py [--experts 8] [--hidden 256] [--rounds 3] [--steps 5] [--smoke]

--smoke: 4 experts, hidden 64, 1 round of 1 step (seconds; numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine.launcher import spawn


def _job(ep: int, args) -> dict:
    return {
        "name": f"bench-moe-ep{ep}",
        "model": {
            "arch": "llama",
            "num_layers": 2,
            "hidden_size": args.hidden,
            "num_attention_heads": 8,
            "seq_length": 256,
            "moe": {"num_experts": args.experts, "top_k": 2, "ffn_hidden_size": 2 * args.hidden},
        },
        "parallel": {"expert": ep},
        "data": {"source": "synthetic"},
        "training": {
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "train_iters": 10**6,
            "log_interval": 10**6,
        },
        "resources": {"ranks": 2, "device": "cpu"},
    }


def _rank(args) -> dict:
    from engine import parallel_state as ps
    from engine.jobspec import JobSpec
    from engine.training import Trainer
    from engine.transformer.moe.token_dispatcher import AllToAllTime

    out = {1: {"step": [], "a2a": []}, 2: {"step": [], "a2a": []}}
    for _ in range(args.rounds):
        for ep in (1, 2):
            trainer = Trainer(JobSpec.model_validate(_job(ep, args)))
            trainer.train_step()  # warm-up
            for _ in range(args.steps):
                AllToAllTime.seconds = 0.0
                start = time.perf_counter()
                trainer.train_step()
                out[ep]["step"].append(time.perf_counter() - start)
                out[ep]["a2a"].append(AllToAllTime.seconds)
            ps.destroy_model_parallel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="4 experts, hidden 64, 1 step: checks, not figures")
    args = ap.parse_args()
    if args.smoke:
        args.experts, args.hidden, args.rounds, args.steps = 4, 64, 1, 1
    res = spawn(_rank, 2, (args,), timeout_s=3600)[0]
    tokens = 8 * 256
    base = statistics.median(res[1]["step"])
    for ep in (1, 2):
        step = statistics.median(res[ep]["step"])
        share = statistics.median(a / s for a, s in zip(res[ep]["a2a"], res[ep]["step"], strict=True))
        print(
            json.dumps(
                {
                    "bench": "moe_expert_parallel",
                    "expert_parallel": ep,
                    "experts": args.experts,
                    "tokens_per_s": tokens / step,
                    "ratio_vs_ep1": base / step,
                    "all_to_all_share": share,
                    "step_s": step,
                }
            )
        )


if __name__ == "__main__":
    main()
