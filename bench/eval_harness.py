"""`elastron eval`'s backend against lm-eval's own Hugging Face backend, same weights, same tasks,
one run; and greedy decoding from the KV cache against re-reading every row.

One random Llama (a BPE vocabulary of 300 trained on the shipped corpus) is imported, trained one
step and checkpointed; the checkpoint is exported to a Hugging Face folder, so both backends read
the same weights in fp32 on CPU, with the same torch threads. The tasks: the shipped multiple
choice (loglikelihood) and generation tasks, and a perplexity task over documents cut from the
shipped corpus (rolling loglikelihood, windows of seq_length). Each backend runs in a fresh rank
process (the same cold start and torch threads; the task data prepared once before either), and
its time is lm-eval's `simple_evaluate` alone (model loading excluded), best of `--repeats`; tokens/s counts the tokens
our backend fed the model (padding excluded), the same requests for both, so the ratio is
HF time / our time. Decoding: `--rows` rows, `--new-tokens` greedy tokens each (no stop), from
the cache and by re-reading, in one rank process. Prints JSON lines.

    python bench/eval_harness.py [--smoke]

--smoke: a 2-layer h32 s64 model and a handful of documents (seconds; numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from engine.data.sources import SHIPPED_CORPUS
from engine.data.tokenizer import write_corpus_bpe
from engine.harness.checkpoint_eval import Layout, eval_job, evaluate_checkpoint, saved_job
from engine.harness.tasks import resolve_tasks
from engine.hf.exporter import export_hf
from engine.launcher import spawn
from engine.train_loop import train_rank

VOCAB = 300
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
)
SMOKE_MODEL = dict(MODEL, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _save_model(root: Path, fields: dict) -> tuple[str, Path]:
    """(checkpoint, exported HF folder) of a random Llama after one step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = root / "hf-in"
    folder.mkdir()
    torch.manual_seed(0)
    config = LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(config).save_pretrained(folder)
    write_corpus_bpe(folder, SHIPPED_CORPUS, VOCAB)
    spec = {
        "name": "bench-eval",
        "model": {"init_from": str(folder), "seq_length": fields["max_position_embeddings"]},
        "data": {"source": "synthetic", "tokenizer": f"hf:{folder}"},
        "training": {"global_batch_size": 2, "micro_batch_size": 2, "train_iters": 1},
        "optimizer": {"lr": 1e-4},
        "checkpoint": {"path": str(root / "ckpt")},
        "resources": {"ranks": 1, "device": "cpu"},
    }
    spawn(train_rank, 1, (spec,), timeout_s=600)
    checkpoint = str(root / "ckpt" / "bench-eval")
    export_hf(checkpoint, str(root / "hf-out"), dtype="fp32")
    return checkpoint, root / "hf-out"


def _corpus_task(root: Path, documents: int, chars: int) -> Path:
    """A perplexity task over `documents` pieces of the shipped corpus, in a task folder."""
    text = SHIPPED_CORPUS.read_text()
    rows = root / "corpus.jsonl"
    with rows.open("w") as f:
        for k in range(documents):
            f.write(json.dumps({"text": text[k * chars : (k + 1) * chars]}) + "\n")
    folder = root / "tasks"
    folder.mkdir()
    task = {
        "task": "bench_corpus_ppl",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(rows)}},
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}],
    }
    (folder / "bench_corpus_ppl.yaml").write_text(json.dumps(task))
    return folder


def _hf_seconds(folder: Path, tasks, batch_size: int) -> tuple[float, dict]:
    """lm-eval's HF backend in a rank process of its own, as ours runs (the same cold start, the
    same torch threads)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(folder), backend="causal", batch_size=batch_size, device="cpu", dtype="float32")
    start = time.perf_counter()
    out = simple_evaluate(model=lm, tasks=tasks.specs, task_manager=tasks.task_manager(), bootstrap_iters=0,
                          log_samples=False)  # fmt: skip
    return time.perf_counter() - start, out["results"]


def _decode_seconds(job: dict, rows: list[list[int]], new_tokens: int) -> dict | None:
    """On one rank: greedy decoding of `rows` from the KV cache and by re-reading them."""
    from engine import parallel_state as ps
    from engine.harness.forward import LayoutForward
    from engine.jobspec import parse_job
    from engine.training import Trainer

    forward = LayoutForward(Trainer(parse_job(job)), rows_per_pass=len(rows))
    never = lambda i, made: False  # noqa: E731 - every row its whole budget
    times = {}
    for cached in (True, False):
        start = time.perf_counter()
        made = forward.greedy(rows, [new_tokens] * len(rows), never, kv_cache=cached)
        times["cached" if cached else "reread"] = (time.perf_counter() - start, made)
    ps.destroy_model_parallel()
    assert times["cached"][1] == times["reread"][1], "the cache decoded other tokens than re-reading"
    return {k: v[0] for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args()
    fields = SMOKE_MODEL if args.smoke else MODEL
    documents, chars = (4, 300) if args.smoke else (48, 2000)
    repeats = 1 if args.smoke else args.repeats
    new_tokens = 8 if args.smoke else args.new_tokens
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        root = Path(tmp)
        checkpoint, exported = _save_model(root, fields)
        tasks = resolve_tasks(["elastron_mc", "elastron_gen", "bench_corpus_ppl"], [str(_corpus_task(root, documents, chars))])
        spawn(_hf_seconds, 1, (exported, tasks, args.batch_size), timeout_s=900)  # datasets' cache, once
        ours = [evaluate_checkpoint(checkpoint, tasks, Layout(), device="cpu", rows_per_pass=args.batch_size)
                for _ in range(repeats)]  # fmt: skip
        theirs = [spawn(_hf_seconds, 1, (exported, tasks, args.batch_size), timeout_s=900)[0] for _ in range(repeats)]
        ours_s, hf_s, tokens = min(o["seconds"] for o in ours), min(t[0] for t in theirs), ours[0]["tokens"]
        same = all(
            ours[0]["results"][t][m] == theirs[0][1][t][m] or abs(ours[0]["results"][t][m] - theirs[0][1][t][m]) < 1e-4 * abs(theirs[0][1][t][m])
            for t in theirs[0][1]
            for m in theirs[0][1][t]
            if isinstance(theirs[0][1][t][m], float) and "_stderr" not in m
        )  # fmt: skip
        print(json.dumps({
            "figure": "eval_throughput", "model": {k: fields[k] for k in ("hidden_size", "num_hidden_layers", "max_position_embeddings")},
            "tasks": [t if isinstance(t, str) else t["task"] for t in tasks.specs], "tokens": tokens,
            "ours_s": round(ours_s, 3), "hf_s": round(hf_s, 3), "ours_tokens_per_s": round(tokens / ours_s, 1),
            "hf_tokens_per_s": round(tokens / hf_s, 1), "ratio_vs_hf": round(hf_s / ours_s, 3), "same_metrics": same,
            "threads": torch.get_num_threads(),
        }), flush=True)  # fmt: skip
        _, saved = saved_job(checkpoint)
        job = eval_job(saved, checkpoint, Layout(), device="cpu")
        rows = [[(7 * r + k) % (VOCAB - 1) + 1 for k in range(4 + 3 * r)] for r in range(args.rows)]
        decode = spawn(_decode_seconds, 1, (job, rows, new_tokens), timeout_s=600)[0]
        print(json.dumps({
            "figure": "decode_kv_cache", "rows": len(rows), "new_tokens": new_tokens,
            "cached_s": round(decode["cached"], 3), "reread_s": round(decode["reread"], 3),
            "speedup": round(decode["reread"] / decode["cached"], 2),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
