"""Per-rank bytes of model params, gradients and optimizer state, per parameter, for every
data-parallel sharding level (`parallel.data_parallel_sharding`) and DP = 1, 2, 4, against
Megatron-FSDP's closed form (bf16 params, fp32 grads and master weights, Adam):
    none                18        bytes/param  (2 param + 4 grad + 4 master + 8 moments)
    optim               6 + 12/d  (ZeRO-1: master and moments sharded)
    optim_grads         2 + 16/d  (ZeRO-2: gradients too)
    optim_grads_params  18/d      (ZeRO-3 / FSDP: parameters too)
plus, while a step runs, the unsharded working set of the largest unit (optim_grads: one
bucket's staged fp32 gradient; optim_grads_params: one layer's gathered bf16 params and staged
fp32 gradient), reported separately. Counts the tensors the engine actually holds after a step
(allocated storage, not an estimate). Also per level: the peak resident memory of a step (the
process's high-water mark during the step, over its resident size before it; CPU, so it
includes allocator slack) and the mean step time relative to `none` at the same DP size, all
in the same run. Prints JSON lines.

    python bench/optimizer_memory.py [--smoke]

--smoke: every level and DP size on a 2-layer h64 s32 model, 1 timed step (seconds; numbers
meaningless).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.training import Trainer

LEVELS = ("none", "optim", "optim_grads", "optim_grads_params")
JOB = {
    "name": "bench-optimizer-memory",
    "model": {
        "arch": "llama",
        "num_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "seq_length": 64,
    },
    "data": {"source": "synthetic"},
    "training": {"global_batch_size": 4, "micro_batch_size": 1, "train_iters": 5, "precision": "bf16"},
}
SMOKE_MODEL = {"num_layers": 2, "hidden_size": 64, "seq_length": 32}


def closed_form(level: str, d: int) -> float:
    return {"none": 18.0, "optim": 6 + 12 / d, "optim_grads": 2 + 16 / d, "optim_grads_params": 18 / d}[level]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def _working_set(trainer: Trainer) -> int:
    """Bytes of the largest transient unsharded piece a step materialises on this rank."""
    worst = 0
    for ddp in trainer.ddp_chunks:
        if ddp.gatherer is not None:
            for unit in [ddp.gatherer.root, *ddp.gatherer.units]:
                n = sum(b.numel for b in unit.buckets)
                worst = max(worst, n * (ddp.buckets[0].full.element_size() + ddp.grad_buffer.element_size()))
        elif ddp.shard_grads:
            worst = max(worst, max(b.numel for b in ddp.buckets) * ddp.grad_buffer.element_size())
    return worst


def _measure(spec_dict: dict) -> dict:
    trainer = Trainer(JobSpec.model_validate(spec_dict))
    trainer.train_step()  # Adam moments exist after the first step
    times, peaks = [], []
    for _ in range(spec_dict["training"]["train_iters"] - 1):
        before = _rss_kib("VmRSS")
        resettable = _reset_peak()
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
        if resettable:
            peaks.append(_rss_kib("VmHWM") - before)
    params = sum(p.numel() for chunk in trainer.model_chunks for p in chunk.parameters())
    return {
        "params": params,
        **trainer.optimizer.state_bytes(),
        "working_set": _working_set(trainer),
        "step_s": sum(times) / len(times),
        "peak_step_kib": max(peaks) if peaks else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 timed step: checks, not figures")
    args = ap.parse_args()
    for dp in (1, 2, 4):
        baseline = None
        for level in LEVELS:
            spec = json.loads(json.dumps(JOB))
            if args.smoke:
                spec["model"].update(SMOKE_MODEL)
                spec["training"]["train_iters"] = 2
            spec["parallel"] = {"data_parallel_sharding": level}
            spec["resources"] = {"ranks": dp, "device": "cpu"}
            per_rank = spawn(_measure, dp, (spec,))
            held = ("master_params", "adam_moments", "grad_buffer", "model_params")
            worst = max(per_rank, key=lambda r: sum(r[k] for k in held))
            n = worst["params"]
            measured = sum(worst[k] for k in held) / n
            step_s = max(r["step_s"] for r in per_rank)
            baseline = step_s if level == "none" else baseline
            closed = closed_form(level, dp)
            peaks = [r["peak_step_kib"] for r in per_rank if r["peak_step_kib"] is not None]
            print(
                json.dumps(
                    {
                        "bench": "optimizer_memory",
                        "data_parallel_sharding": level,
                        "dp": dp,
                        "params": n,
                        "bytes_per_param": round(measured, 3),
                        "closed_form": round(closed, 3),
                        "ratio_measured_over_closed_form": round(measured / closed, 4),
                        "working_set_bytes_per_param": round(worst["working_set"] / n, 3),
                        "breakdown_bytes_per_param": {k: round(worst[k] / n, 3) for k in held},
                        "peak_step_mib": round(max(peaks) / 1024, 1) if peaks else None,
                        "step_time_s": round(step_s, 4),
                        "step_time_vs_none": round(step_s / baseline, 3),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
