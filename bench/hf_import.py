"""Hugging Face import into TP=2 against transformers' own from_pretrained of the same folder.

A ~1 GB (bf16) Llama-shaped folder is written here with random tensors (safetensors, sharded
like the Hub's, no download), then, in the same run:
- reference: `LlamaForCausalLM.from_pretrained(folder, dtype=bfloat16)` in this process (model
  construction + load of every tensor);
- ours: 2 spawned ranks (TP=2, gloo) each build their half of the model in bf16 and import it
  (`engine.hf.importer.import_hf_weights`), timed per rank from model construction to the last
  tensor copied; the slower rank counts.
Prints JSON lines: seconds of each, the ratio reference / ours (target >= 1.0: our 2-rank import
is at least as fast as one transformers load) and the bytes each rank read over the folder's
size (target about 0.5).

    python bench/hf_import.py [--layers 8] [--hidden 2048] [--shard-mb 400] [--smoke]

`--smoke`: a 1-layer, hidden-512 folder (~70 MB, 16 MB shards, still several) in seconds, to
check that every step runs and prints its lines; its figures are not measurements.

Both sides read the same files from the page cache after the first pass: run the reference
first, once untimed, so neither side pays for the cold read alone.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from engine.launcher import spawn


def write_folder(folder: Path, layers: int, hidden: int, shard_mb: int) -> dict:
    from safetensors.torch import save_file

    heads, groups, ffn, vocab = hidden // 64, hidden // 256, int(hidden * 2.75) // 64 * 64, 32000
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "dtype": "bfloat16",
    }
    d = hidden // heads
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (hidden,),
                f"{p}.post_attention_layernorm.weight": (hidden,),
                f"{p}.self_attn.q_proj.weight": (heads * d, hidden),
                f"{p}.self_attn.k_proj.weight": (groups * d, hidden),
                f"{p}.self_attn.v_proj.weight": (groups * d, hidden),
                f"{p}.self_attn.o_proj.weight": (hidden, heads * d),
                f"{p}.mlp.gate_proj.weight": (ffn, hidden),
                f"{p}.mlp.up_proj.weight": (ffn, hidden),
                f"{p}.mlp.down_proj.weight": (hidden, ffn),
            }
        )
    g = torch.Generator().manual_seed(0)
    shards, size, weight_map = [{}], 0, {}
    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        if shards[-1] and size + t.numel() * 2 > shard_mb * 2**20:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps(config))
    return config


def import_rank(folder: str) -> dict:
    from engine import parallel_state as ps
    from engine.hf.importer import import_hf_weights
    from engine.jobspec import parse_job
    from engine.models import GPTModel
    from engine.transformer.config import TransformerConfig

    spec = parse_job(  # reads config.json into the model fields (JobSpec validation reads nothing)
        {
            "model": {"init_from": folder, "seq_length": 128},
            "parallel": {"tensor": 2},
            "training": {"precision": "bf16", "global_batch_size": 1, "micro_batch_size": 1},
            "data": {"source": "synthetic"},
            "resources": {"ranks": 2, "device": "cpu"},
        }
    )
    ps.initialize_model_parallel(tensor=2)
    start = time.perf_counter()
    config = TransformerConfig.from_job(spec, spec.model.vocab_size)
    model = GPTModel(config)  # allocated, not initialised: as Trainer does when it imports
    report = import_hf_weights([model], folder, "LlamaForCausalLM", config)
    seconds = time.perf_counter() - start
    ps.destroy_model_parallel()
    return {"seconds": seconds, "bytes_read": report.bytes_read, "file_bytes": report.file_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--shard-mb", type=int, default=400)
    ap.add_argument("--smoke", action="store_true", help="a tiny folder: a quick check that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.shard_mb = 1, 512, 16
    if args.hidden % 512:
        ap.error("--hidden must be a multiple of 512: TP=2 splits its hidden // 256 KV heads")
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        folder = Path(tmp)
        write_folder(folder, args.layers, args.hidden, args.shard_mb)
        total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        print(json.dumps({"folder_bytes": total, "layers": args.layers, "hidden": args.hidden}), flush=True)
        LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)  # warm the page cache
        start = time.perf_counter()
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        lazy = time.perf_counter() - start
        with torch.no_grad():  # the weights in the process's own memory, as a training job needs them
            for p in model.parameters():
                p.data = p.data.clone()
        reference = time.perf_counter() - start
        del model
        ranks = spawn(import_rank, 2, (str(folder),), timeout_s=900)
        ours = max(r["seconds"] for r in ranks)
        print(
            json.dumps(
                {"reference": "transformers from_pretrained (memory-mapped, lazy)", "seconds": round(lazy, 3)}
            )
        )
        print(
            json.dumps(
                {
                    "reference": "transformers from_pretrained + every weight in memory",
                    "seconds": round(reference, 3),
                }
            )
        )
        print(
            json.dumps(
                {
                    "ours": "import TP=2",
                    "seconds": round(ours, 3),
                    "speedup_vs_reference": round(reference / ours, 3),
                    "bytes_read_per_rank_over_folder": [round(r["bytes_read"] / total, 3) for r in ranks],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
