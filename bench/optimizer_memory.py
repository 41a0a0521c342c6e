"""Per-rank bytes of model params, gradient buffer and optimizer state, per parameter, with and
without the distributed optimizer, for DP = 1, 2, 4, against Megatron-Core's closed form
(bf16 params, fp32 grads and master weights, Adam):
    unsharded: 2 (param) + 4 (grad) + 4 (master) + 8 (moments) = 18 bytes/param
    distributed optimizer over d ranks: 6 + 12/d bytes/param
Counts the tensors the engine actually holds after one step (not an estimate). Prints JSON lines.

    python bench/optimizer_memory.py
"""

from __future__ import annotations

import json

from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.training import Trainer

JOB = {
    "name": "bench-optimizer-memory",
    "model": {
        "arch": "llama",
        "num_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "seq_length": 32,
    },
    "data": {"source": "synthetic"},
    "training": {"global_batch_size": 4, "micro_batch_size": 1, "train_iters": 1, "precision": "bf16"},
}


def _measure(spec_dict: dict) -> dict:
    trainer = Trainer(JobSpec.model_validate(spec_dict))
    trainer.train_step()  # Adam moments exist after the first step
    params = sum(p.numel() for chunk in trainer.model_chunks for p in chunk.parameters())
    return {"params": params, **trainer.optimizer.state_bytes()}


def main() -> None:
    for distributed in (False, True):
        for dp in (1, 2, 4):
            spec = json.loads(json.dumps(JOB))
            spec["parallel"] = {"distributed_optimizer": distributed}
            spec["resources"] = {"ranks": dp, "device": "cpu"}
            per_rank = spawn(_measure, dp, (spec,))
            worst = max(per_rank, key=lambda r: sum(v for k, v in r.items() if k != "params"))
            n = worst["params"]
            measured = sum(v for k, v in worst.items() if k != "params") / n
            closed = 6 + 12 / dp if distributed else 18.0
            print(
                json.dumps(
                    {
                        "bench": "optimizer_memory",
                        "distributed_optimizer": distributed,
                        "dp": dp,
                        "params": n,
                        "bytes_per_param": round(measured, 3),
                        "closed_form": round(closed, 3),
                        "ratio_measured_over_closed_form": round(measured / closed, 4),
                        "breakdown_bytes_per_param": {
                            k: round(v / n, 3) for k, v in worst.items() if k != "params"
                        },
                    }
                )
            )


if __name__ == "__main__":
    main()
