"""Does the engine compute the same training run in bf16 on this device as in fp32 on the CPU?

The tiny Llama (tests/tiny_jobs.py's shape at seq 128) trains 20 steps on the shipped text
corpus twice from the same seed and data: fp32 on CPU (the reference every parallel layout is
already proven against) and bf16 on `--device` (CUDA on a GPU machine). bf16 keeps 8 bits of
mantissa, so each rounding is off by up to 2^-9 (0.2 %) and the two runs drift apart step by
step; what must hold is that they stay close. Bounds, per step:

- |loss_bf16 - loss_fp32| <= 0.02 + 1 % of loss_fp32: a systematic error (a wrong kernel, a
  dtype lost in a cast, a mis-scaled gradient) moves the loss by far more than that within 20
  steps at lr 3e-3, while measured bf16 noise on this model stays well under it (the JSON
  reports the largest difference seen, to compare with the bound);
- |grad_norm_bf16 / grad_norm_fp32 - 1| <= 5 % at step 1 (same weights, one step of rounding);
- both losses fall by at least 0.5 over the 20 steps (the run learns at all).

Writes one JSON object (stdout and `--out`); exit 1 when a bound fails.

    python scripts/gpu_correctness.py --device cuda --out runs/gpu-check/correctness.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STEPS = 20
LOSS_ABS, LOSS_REL, GRAD_REL, MIN_DROP = 0.02, 0.01, 0.05, 0.5


def job(precision: str, device: str, steps: int) -> dict:
    from tests.tiny_jobs import TINY_LLAMA

    return {
        "name": f"correctness-{precision}-{device}",
        "model": {**TINY_LLAMA, "seq_length": 128},
        "data": {"source": "text", "tokenizer": "byte"},
        "training": {"global_batch_size": 8, "micro_batch_size": 4, "train_iters": steps, "precision": precision},
        "optimizer": {"lr": 3e-3, "lr_warmup_iters": 2, "lr_decay_style": "constant"},
        "resources": {"ranks": 1, "device": device},
    }


def run(spec: dict, device_type: str) -> list[dict]:
    from engine.jobspec import resolve_job
    from engine.launcher import spawn
    from engine.train_loop import train_rank

    return spawn(train_rank, 1, (resolve_job(spec), None, True), device_type=device_type, timeout_s=600)[0]


def compare(reference: list[dict], candidate: list[dict]) -> dict:
    diffs = [abs(c["loss"] - r["loss"]) for r, c in zip(reference, candidate, strict=True)]
    bounds = [LOSS_ABS + LOSS_REL * r["loss"] for r in reference]
    grad_rel = abs(candidate[0]["grad_norm"] / reference[0]["grad_norm"] - 1)
    failures = [
        f"step {i + 1}: |loss diff| {d:.4f} > {b:.4f}" for i, (d, b) in enumerate(zip(diffs, bounds, strict=True)) if d > b
    ]
    if grad_rel > GRAD_REL:
        failures.append(f"step 1 grad norm differs by {grad_rel:.1%} > {GRAD_REL:.0%}")
    for name, recs in (("fp32 reference", reference), ("bf16", candidate)):
        if recs[0]["loss"] - recs[-1]["loss"] < MIN_DROP:
            failures.append(f"{name} loss fell by {recs[0]['loss'] - recs[-1]['loss']:.3f} < {MIN_DROP}")
    return {
        "max_loss_diff": max(diffs),
        "max_loss_diff_over_bound": max(d / b for d, b in zip(diffs, bounds, strict=True)),
        "grad_norm_rel_diff_step1": grad_rel,
        "loss_fp32": [round(r["loss"], 5) for r in reference],
        "loss_bf16": [round(c["loss"], 5) for c in candidate],
        "failures": failures,
        "ok": not failures,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from engine.device import resolve_device_type

    device_type = resolve_device_type(args.device)
    reference = run(job("fp32", "cpu", args.steps), "cpu")
    candidate = run(job("bf16", device_type, args.steps), device_type)
    result = {"check": "bf16_vs_fp32", "device": device_type, "steps": args.steps, **compare(reference, candidate)}
    text = json.dumps(result)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
