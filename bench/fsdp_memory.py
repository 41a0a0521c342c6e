"""Peak resident memory per rank of every data-parallel sharding level, against torch's DDP and
FSDP2 on a model of the same shape and the same batch, in one run.

For `none`, `optim`, `optim_grads`, `optim_grads_params` (2 CPU ranks over gloo) and HSDP
(`optim_grads_params` with data_parallel_shard_size 2 on 4 ranks: 2 shards x 2 replicas), each
rank process records its high-water mark (VmHWM, reset through /proc/self/clear_refs at the
start of each phase) for four phases: `build` (the Trainer: model, data parallelism, optimizer),
`step` (two training steps: Adam's moments exist after the first), `save` (a persistent
checkpoint) and `load` (resuming that checkpoint into the same trainer); the step time (the
second step) and the engine's own byte accounting (TrainingOptimizer.state_bytes). The
references are transformers' LlamaForCausalLM of the same shape (hidden, layers, heads, query
groups, ffn, padded vocabulary), fp32, AdamW (foreach), wrapped in torch DDP or in FSDP2
(`fully_shard` per decoder layer, then the root), build and one measured step on a random
batch of the same shape. Every configuration runs in fresh rank processes. Prints one JSON line
per configuration, then one with the ratios the issue targets: optim_grads_params' peak and
step over FSDP2's, and its save/load peaks over its step peak.

    python bench/fsdp_memory.py [--smoke] [--layers 16] [--hidden 1024]

--smoke: a 2-layer h64 s32 model (seconds; numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from engine.launcher import spawn

LEVELS = ("none", "optim", "optim_grads", "optim_grads_params")


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


class Phases:
    """VmHWM per phase: the peak is reset to the current RSS when a phase starts."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.resettable = True

    def start(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.resettable = False

    def end(self, name: str) -> None:
        self.peaks[name] = round(_kib("VmHWM") / 1024, 1)


def job(layers: int, hidden: int, heads: int, seq: int, micro: int, ranks: int, sharding: str, path: str, **par):
    return {
        "name": "bench-fsdp-memory",
        "model": {
            "arch": "llama",
            "num_layers": layers,
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "seq_length": seq,
        },
        "data": {"source": "synthetic"},
        "training": {"global_batch_size": micro * ranks, "micro_batch_size": micro, "train_iters": 10},
        "parallel": {"data_parallel_sharding": sharding, **par},
        "checkpoint": {"path": path},
        "resources": {"ranks": ranks, "device": "cpu"},
    }


def _ours(spec_dict: dict) -> dict:
    import transformers.models.llama  # noqa: F401 - the same imports as the references: same baseline

    from engine.jobspec import JobSpec
    from engine.training import Trainer

    phases = Phases()
    phases.start()
    trainer = Trainer(JobSpec.model_validate(spec_dict))
    phases.end("build")
    phases.start()
    trainer.train_step()
    start = time.perf_counter()
    trainer.train_step()
    step_s = time.perf_counter() - start
    phases.end("step")
    held = trainer.optimizer.state_bytes()
    phases.start()
    trainer.checkpointer.save()
    trainer.checkpointer.wait()
    phases.end("save")
    phases.start()
    resumed = trainer.checkpointer.maybe_resume()
    phases.end("load")
    assert resumed == trainer.iteration, (resumed, trainer.iteration)
    params = sum(p.numel() for chunk in trainer.model_chunks for p in chunk.parameters())
    return {"peaks": phases.peaks, "step_s": step_s, "held": held, "params": params}


def _llama(shape: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["groups"],
        max_position_embeddings=shape["seq"],
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _torch(kind: str, shape: dict) -> dict:
    import torch.distributed as dist

    phases = Phases()
    phases.start()
    model = _llama(shape)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    phases.end("build")
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, shape["vocab"], (shape["micro"], shape["seq"]), generator=gen)
    phases.start()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    phases.end("step")
    params = sum(p.numel() for p in model.parameters())  # a DTensor counts its global size
    return {"peaks": phases.peaks, "step_s": times[-1], "params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model: checks, not figures")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    args = ap.parse_args()
    layers, hidden, heads, seq, micro = args.layers, args.hidden, 16, 64, 4
    if args.smoke:
        layers, hidden, heads, seq, micro = 2, 64, 4, 32, 2
    from engine.jobspec import JobSpec
    from engine.transformer.config import TransformerConfig

    probe = JobSpec.model_validate(job(layers, hidden, heads, seq, micro, 2, "none", "/tmp/x"))
    config = TransformerConfig.from_job(probe, 257)  # the synthetic source's byte vocabulary
    shape = {
        "vocab": config.padded_vocab_size,
        "hidden": hidden,
        "ffn": config.ffn_hidden_size,
        "layers": layers,
        "heads": heads,
        "groups": probe.model.num_query_groups,
        "seq": seq,
        "micro": micro,
    }
    configs: list[tuple[str, int, object, tuple]] = [("torch DDP", 2, _torch, ("ddp", shape))]
    configs.append(("torch FSDP2", 2, _torch, ("fsdp2", shape)))
    with tempfile.TemporaryDirectory() as tmp:
        for level in LEVELS:
            configs.append((level, 2, _ours, (job(layers, hidden, heads, seq, micro, 2, level, f"{tmp}/{level}"),)))
        hsdp = job(layers, hidden, heads, seq, micro, 4, "optim_grads_params", f"{tmp}/hsdp", data_parallel_shard_size=2)
        configs.append(("HSDP (optim_grads_params, 2 shards x 2 replicas, 4 ranks)", 4, _ours, (hsdp,)))
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        rows = {}
        for name, ranks, fn, fn_args in configs:
            if only and name.split(" (")[0] not in only:
                continue
            per_rank = spawn(fn, ranks, fn_args, timeout_s=1800.0)
            peaks = {ph: max(r["peaks"][ph] for r in per_rank) for ph in per_rank[0]["peaks"]}
            row = {
                "bench": "fsdp_memory",
                "config": name,
                "ranks": ranks,
                "params": per_rank[0]["params"],
                "peak_mib": max(peaks.values()),
                "phase_peak_mib": peaks,
                "step_s": round(max(r["step_s"] for r in per_rank), 3),
            }
            if "held" in per_rank[0]:
                row["engine_bytes_mib"] = {k: round(v / 2**20, 1) for k, v in per_rank[0]["held"].items()}
            rows[name] = row
            print(json.dumps(row), flush=True)
    ours, fsdp = rows.get("optim_grads_params"), rows.get("torch FSDP2")
    if ours and fsdp:
        step = ours["phase_peak_mib"]["step"]
        print(
            json.dumps(
                {
                    "bench": "fsdp_memory",
                    "summary": "optim_grads_params vs torch FSDP2",
                    "peak_ratio": round(ours["peak_mib"] / fsdp["peak_mib"], 3),
                    "step_time_ratio": round(ours["step_s"] / fsdp["step_s"], 3),
                    "save_over_step_peak": round(ours["phase_peak_mib"]["save"] / step, 3),
                    "load_over_step_peak": round(ours["phase_peak_mib"]["load"] / step, 3),
                    "smoke": args.smoke,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
