"""Model FLOPs utilisation of one rank on one GPU, against plain PyTorch in the same run.

For each size, in this order and each in a fresh rank process (so one run's memory is not the
next one's):

- `engine`: elastron's Trainer, bf16 with fp32 master weights and grads (the job a user would
  submit), one rank, no recomputation; tokens/s, achieved TFLOP/s and MFU by engine/flops.py
  (the model FLOPs Megatron-Core counts, over the device's datasheet peak), peak device memory;
- `reference`: the same model shape as Hugging Face's `LlamaForCausalLM` with SDPA attention,
  fp32 weights under bf16 autocast (what transformers' Trainer does with `bf16=True`), fused
  AdamW and the same global grad-norm clip, same global and micro batch: what a user would run
  instead. Its TFLOP/s uses the same FLOP count, so the ratio is one of tokens/s;
- `compile` (`--compile`): the engine with `training.compile: true`;
- `fp8` (`--fp8`, compute capability >= 8.9): the engine with `training.fp8: true` against the
  `engine` run for `--fp8-steps` steps on the same data and seed: speed-up and the loss
  difference at the last step (the engine runs on the shipped text corpus, so its loss falls and
  the two curves can be compared; the reference's tokens are random: only its speed matters).

Sizes are Llama 3.2's shapes (1b: 16 x 2048, ffn 8192, 32 heads / 8 KV heads; 3b: 28 x 3072,
24 / 8 heads; vocabulary 128,256, tied embeddings) at seq 4096; `tiny` is for CPU, where the
script only has to run (`scripts/gpu_check.sh --cpu`). One JSON line per run on stdout, and the
same lines appended to `--out` as each run finishes, so a run cut short still leaves its figures.

    python bench/gpu_mfu.py --sizes 1b,3b --compile --fp8 --out runs/gpu-check/mfu.jsonl
    python bench/gpu_mfu.py --sizes tiny --device cpu
    python bench/gpu_mfu.py --smoke   # = --sizes tiny --device cpu --steps 4 --warmup 1 --compile
                                      #   --fp8 --fp8-compile --fp8-steps 6: every run, on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

VOCAB = 128256
SHAPES: dict[str, dict[str, Any]] = {
    # layers, hidden, ffn, heads, kv heads, vocab; micro batch, global batch at seq_length
    "1b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
               num_query_groups=8, vocab_size=VOCAB, seq_length=4096, micro_batch=2, global_batch=4),
    "3b": dict(num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
               num_query_groups=8, vocab_size=VOCAB, seq_length=4096, micro_batch=1, global_batch=4),
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                 num_query_groups=2, vocab_size=512, seq_length=64, micro_batch=2, global_batch=4),
}


def engine_job(s: dict, device: str, steps: int, *, compile: bool = False, fp8: bool = False) -> dict:
    """The job for shape `s` (a SHAPES entry, batch overrides applied)."""
    return {
        "name": "mfu",
        "model": {
            "arch": "llama",
            "num_layers": s["num_layers"],
            "hidden_size": s["hidden_size"],
            "ffn_hidden_size": s["ffn_hidden_size"],
            "num_attention_heads": s["num_attention_heads"],
            "num_query_groups": s["num_query_groups"],
            "vocab_size": s["vocab_size"],
            "seq_length": s["seq_length"],
            "tie_embeddings": True,
            "rotary_base": 500000.0,
        },
        # The shipped corpus with the byte tokenizer: a loss that falls (the fp8 comparison needs
        # one); the embedding keeps Llama's vocabulary size, so the FLOPs are Llama's.
        "data": {"source": "text", "tokenizer": "byte"},
        "training": {
            "global_batch_size": s["global_batch"],
            "micro_batch_size": s["micro_batch"],
            "train_iters": steps,
            "precision": "bf16",
            "compile": compile,
            "fp8": fp8,
            "log_interval": 10**6,
        },
        "optimizer": {"lr": 3e-4, "lr_warmup_iters": 2, "lr_decay_style": "constant", "weight_decay": 0.1},
        "resources": {"ranks": 1, "device": device},
    }


def _summary(step_times: list[float], tokens: int, flops: float, peak: float) -> dict[str, float]:
    t = statistics.median(step_times)
    return {
        "step_time_s": t,
        "tokens_per_s": tokens / t,
        "tflops_per_s": flops / t / 1e12,
        "mfu": flops / t / peak,
    }


def run_engine(job: dict, warmup: int) -> dict:
    """One rank (launched by engine.launcher): train the job, time the steps after `warmup`."""
    from engine.jobspec import JobSpec
    from engine.training import Trainer

    trainer = Trainer(JobSpec.model_validate(job))
    records = []
    start = time.perf_counter()
    while trainer.iteration < trainer.spec.training.train_iters:
        m = trainer.train_step()
        if m is not None:
            records.append(m)
        if len(records) == 1:
            first_step_s = time.perf_counter() - start
    timed = records[warmup:] or records[-1:]
    out = _summary([m.step_time_s for m in timed], timed[0].tokens, timed[0].model_flops, trainer.meter.peak_flops_per_device)
    peaks = [m.memory_peak_bytes for m in records if m.memory_peak_bytes is not None]
    out.update(
        steps=len(records),
        first_step_s=first_step_s,
        params=sum(p.numel() for p in trainer.model.parameters()),
        peak_tflops=trainer.meter.peak_flops_per_device / 1e12,
        memory_peak_gib=max(peaks) / 2**30 if peaks else None,
        loss_first=records[0].loss,
        loss_last=records[-1].loss,
        losses=[round(m.loss, 5) for m in records],
        power_w=statistics.median([m.power_w for m in timed]) if timed[0].power_w is not None else None,
    )
    return out


def run_reference(s: dict, device_type: str, steps: int, warmup: int) -> dict:
    """The same shape and batch as Hugging Face LlamaForCausalLM, trained the plain way."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import device
    from engine.flops import model_flops_per_iteration, peak_flops
    from engine.jobspec import JobSpec
    from engine.transformer.config import TransformerConfig

    spec = JobSpec.model_validate(engine_job(s, device_type, steps))
    config = TransformerConfig.from_job(spec, s["vocab_size"])
    flops = model_flops_per_iteration(config, s["global_batch"])
    dev = device.current_device()
    hf = LlamaConfig(
        vocab_size=s["vocab_size"],
        hidden_size=s["hidden_size"],
        intermediate_size=s["ffn_hidden_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_query_groups"],
        max_position_embeddings=s["seq_length"],
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(hf)
    model.train()
    cuda = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    micro, n_micro = s["micro_batch"], s["global_batch"] // s["micro_batch"]
    seq = s["seq_length"]
    times, losses, peaks = [], [], []
    for _ in range(steps):
        batch = torch.randint(0, s["vocab_size"], (s["global_batch"], seq), device=dev)
        device.synchronize()
        device.reset_peak_memory()
        t0 = time.perf_counter()
        total = 0.0
        for i in range(n_micro):
            ids = batch[i * micro : (i + 1) * micro]
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / n_micro
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        device.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(total))
        memory = device.memory_bytes()
        peaks.append(memory[1] if memory else None)
    peak = peak_flops(dev.type, torch.bfloat16).flops_per_s
    out = _summary(times[warmup:] or times[-1:], s["global_batch"] * seq, flops, peak)
    out.update(
        steps=steps,
        params=sum(p.numel() for p in model.parameters()),
        memory_peak_gib=max(peaks) / 2**30 if peaks[0] is not None else None,  # over the steps, as ours
        loss_last=losses[-1],
        transformers=__import__("transformers").__version__,
    )
    return out


def _spawn(fn, args: tuple, device_type: str, timeout_s: float) -> dict:
    from engine.launcher import RankFailure, spawn

    t0 = time.perf_counter()
    try:
        result = spawn(fn, 1, args, device_type=device_type, timeout_s=timeout_s)[0]
    except RankFailure as err:
        text = str(err)
        reason = "out of memory" if "OutOfMemoryError" in text or "out of memory" in text else "failed"
        return {"error": reason, "detail": text[-2000:], "wall_s": time.perf_counter() - t0}
    result["wall_s"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1b,3b", help="Comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=12, help="Steps per run (the first --warmup are not timed).")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="Also run the engine with training.compile.")
    ap.add_argument("--compile-sizes", default=None, help="Sizes to compile (default: all of --sizes).")
    ap.add_argument("--fp8", action="store_true", help="Also run training.fp8 against bf16 (first size).")
    ap.add_argument("--fp8-steps", type=int, default=50)
    ap.add_argument(
        "--fp8-compile", action="store_true",
        help="Compile the fp8 run too, and compare its speed with the compiled bf16 run (needs --compile): "
        "eager float8 casts cost more than the GEMMs save.",
    )
    ap.add_argument("--micro-batch", type=int, default=None, help="Override every size's micro batch.")
    ap.add_argument("--global-batch", type=int, default=None, help="Override every size's global batch.")
    ap.add_argument("--no-reference", action="store_true", help="Skip the Hugging Face reference.")
    ap.add_argument("--timeout", type=float, default=600.0, help="Seconds per run before it counts as failed.")
    ap.add_argument("--out", type=Path, default=None, help="Append each run's JSON line here.")
    ap.add_argument(
        "--smoke", action="store_true",
        help="Every run on the tiny CPU size, a few steps (compile included: about half a minute on 2 cores).",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes, args.device, args.steps, args.warmup, args.fp8_steps = "tiny", "cpu", 4, 1, 6
        args.compile = args.fp8 = args.fp8_compile = True
        args.compile_sizes, args.no_reference = None, False

    from engine.device import resolve_device_type

    device_type = resolve_device_type(args.device)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        ap.error(f"--sizes: unknown {unknown}; choose from {sorted(SHAPES)}")
    compile_sizes = sizes if args.compile_sizes is None else args.compile_sizes.split(",")
    shapes = {
        name: {**shape, "micro_batch": args.micro_batch or shape["micro_batch"],
               "global_batch": args.global_batch or shape["global_batch"]}
        for name, shape in SHAPES.items()
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)

    def emit(line: dict) -> dict:
        text = json.dumps(line)
        print(text, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(text + "\n")
        return line

    from engine.tensor_parallel.fp8 import unsupported

    fp8_why = unsupported(device_type)
    fp8_ok = fp8_why is None
    for n, size in enumerate(sizes):
        shape = shapes[size]
        common = {"bench": "gpu_mfu", "size": size, "device": device_type, "seq": shape["seq_length"],
                  "micro_batch": shape["micro_batch"], "global_batch": shape["global_batch"]}
        # The first size's bf16 run is also the fp8 comparison's baseline: run it that long.
        fp8_here = args.fp8 and n == 0
        steps = max(args.steps, args.fp8_steps) if fp8_here and fp8_ok else args.steps
        ours = emit({**common, "run": "engine", **_spawn(run_engine, (engine_job(shape, device_type, steps), args.warmup), device_type, args.timeout)})
        if not args.no_reference:
            ref = _spawn(run_reference, (shape, device_type, args.steps, args.warmup), device_type, args.timeout)
            if "tokens_per_s" in ref and "tokens_per_s" in ours:
                ref["engine_over_reference"] = ours["tokens_per_s"] / ref["tokens_per_s"]
            emit({**common, "run": "reference", **ref})
        comp: dict = {}
        if args.compile and size in compile_sizes:
            comp = _spawn(run_engine, (engine_job(shape, device_type, args.steps, compile=True), args.warmup), device_type, args.timeout)
            if "tokens_per_s" in comp and "tokens_per_s" in ours:
                comp["over_eager"] = comp["tokens_per_s"] / ours["tokens_per_s"]
            emit({**common, "run": "compile", **comp})
        if fp8_here:
            if not fp8_ok:
                emit({**common, "run": "fp8", "skipped": fp8_why})
                continue
            compiled = args.fp8_compile and "tokens_per_s" in comp
            fp8 = _spawn(
                run_engine,
                (engine_job(shape, device_type, steps, fp8=True, compile=compiled), args.warmup),
                device_type,
                args.timeout,
            )
            fp8["compiled"] = compiled
            baseline = comp if compiled else ours
            if "tokens_per_s" in fp8 and "tokens_per_s" in baseline:
                fp8["speedup_over_bf16"] = fp8["tokens_per_s"] / baseline["tokens_per_s"]
            if "loss_last" in fp8 and "loss_last" in ours:  # the bf16 run as long as this one
                fp8["loss_diff_last"] = fp8["loss_last"] - ours["loss_last"]
                fp8["bf16_loss_last"] = ours["loss_last"]
            emit({**common, "run": "fp8", **fp8})
    return 0


if __name__ == "__main__":
    sys.exit(main())
