"""Tiny random Hugging Face models written in the test itself (no download), and what the HF
import/export tests run on each rank: import, logits of one batch gathered whole, one step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.data.sources import SyntheticSource
from engine.jobspec import parse_job
from engine.training import Trainer

SEQ = 16
SEED = 3


# The tiny Llama the import, family and LoRA tests save and load (vocabulary 300).
TINY_LLAMA = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=500000.0,
    max_position_embeddings=64,
)


def save_tiny(folder, config_cls, model_cls, seed: int = 0, dtype=torch.float32, **fields):
    """A random HF model of `config_cls(**fields)` saved to `folder`; returns the model (eval)."""
    torch.manual_seed(seed)
    config = config_cls(**fields)
    config.architectures = [model_cls.__name__]
    model = model_cls(config).to(dtype).eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(folder)
    return model


def write_tokenizer(folder, vocab_size: int = 300) -> None:
    """A small byte-level BPE tokenizer.json (+ tokenizer_config.json) trained on the shipped corpus."""
    from engine.data.sources import SHIPPED_CORPUS
    from engine.data.tokenizer import write_corpus_bpe

    write_corpus_bpe(folder, SHIPPED_CORPUS, vocab_size)


def upload(folder, bucket: str, prefix: str) -> str:
    """Every file of `folder` to s3://bucket/prefix/ (boto3's default chain); returns the URI."""
    import boto3

    s3 = boto3.client("s3")
    for path in folder.iterdir():
        s3.upload_file(str(path), bucket, f"{prefix}/{path.name}")
    return f"s3://{bucket}/{prefix}"


def batch(vocab: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` samples of the jobs' synthetic data, as (tokens, labels)."""
    rows = torch.stack([SyntheticSource(vocab, SEQ, SEED)[i] for i in range(count)])
    return rows[:, :-1], rows[:, 1:]


def hf_logits_and_loss(model, vocab: int, count: int) -> tuple[torch.Tensor, float]:
    tokens, labels = batch(vocab, count)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return logits, float(loss)


def job(folder, ranks: int = 1, **sections) -> dict:
    spec = {
        "name": "hf",
        "model": {"init_from": str(folder), "seq_length": SEQ},
        "data": {"source": "synthetic", "tokenizer": "byte"},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "train_iters": 1, "seed": SEED},
        "optimizer": {"lr": 1e-3, "clip_grad": 0.0, "adam_eps": 1e-6},  # see parallel_harness on eps
        "resources": {"ranks": ranks, "device": "cpu"},
    }
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return spec


def full_logits(trainer: Trainer, tokens: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor | None:
    """Logits [b, s, vocab] of `tokens` (and the model's further keyword `inputs`: masks, token
    types, decoder ids), whole on the last pipeline stage (None on the first of two)."""
    chunk = trainer.model_chunks[0].eval()
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        if pp == 1:
            out = chunk(tokens, **inputs)
        else:  # two stages: hidden states go from rank 0's stage to the next by hand
            peer = dist.get_global_rank(ps.get_group("pp"), 1 - stage)
            if stage == 0:
                dist.send(chunk(tokens, **inputs).contiguous(), peer)
                chunk.train()
                return None
            seq = tokens.shape[1] // tp if trainer.config.sequence_parallel else tokens.shape[1]
            hidden = torch.empty(seq, tokens.shape[0], trainer.config.hidden_size)
            dist.recv(hidden, peer)
            out = chunk(hidden, **inputs)
        if tp > 1:
            parts = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
            out = torch.cat(parts, dim=-1)
    chunk.train()
    return out.float()


def import_forward_step(spec: dict, vocab: int) -> dict:
    """On every rank: import, the logits of the job's first micro-batch, one training step."""
    trainer = Trainer(parse_job(spec))
    tokens, _ = batch(vocab, spec["training"]["micro_batch_size"])
    logits = full_logits(trainer, tokens)
    step = trainer.train_step()
    report = trainer.hf_import
    ps.destroy_model_parallel()
    return {
        "logits": logits,
        "loss": step.loss,
        "bytes_read": report.bytes_read,
        "file_bytes": report.file_bytes,
    }


def train_then_logits(spec: dict, vocab: int, stop_at: int | None = None) -> dict:
    """On every rank: import, train to `stop_at` (default: `train_iters`; checkpoints as the
    job says), then the logits of the first micro-batch."""
    trainer = Trainer(parse_job(spec))
    losses = []
    while trainer.iteration < (stop_at or trainer.spec.training.train_iters):
        losses.append(trainer.train_step().loss)
        trainer.save_checkpoint_if_due()
    trainer.checkpointer.wait()
    tokens, _ = batch(vocab, spec["training"]["micro_batch_size"])
    logits = full_logits(trainer, tokens)
    ps.destroy_model_parallel()
    return {"logits": logits, "losses": losses, "imported": trainer.hf_import is not None}


def import_save_step(spec: dict, vocab: int) -> dict:
    """On every rank: import, save a checkpoint before any step (iteration 0: the imported
    weights as they are), the first micro-batch's logits, then one step's loss."""
    trainer = Trainer(parse_job(spec))
    trainer.checkpointer.save()
    trainer.checkpointer.wait()
    tokens, _ = batch(vocab, spec["training"]["micro_batch_size"])
    logits = full_logits(trainer, tokens)
    step = trainer.train_step()
    ps.destroy_model_parallel()
    return {"logits": logits, "loss": step.loss}
