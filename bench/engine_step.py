"""Step time of elastron's engine on 1 rank against plain PyTorch, same architecture, same process.

The plain model is written here the way a PyTorch user would (separate q/k/v and gate/up/down
linears, [batch, seq, hidden], the tokenizer's vocabulary: ours pads it to a multiple of 128 and
masks the padded logits to -inf, which is the same model); it gets our model's weights, and the
two first-step losses must agree before anything is timed, so the ratio compares the same math.
A step is forward, backward, global grad-norm clip and AdamW on one global batch. Runs alternate
(ours, plain, ours, ...) so drift on a shared machine hits both. Prints one JSON line per figure.

    python bench/engine_step.py [--precision fp32|bf16] [--steps 10] [--rounds 3] [--smoke]

--smoke: a 2-layer h64 s32 model, 2 steps, 1 round, 1 warm-up step (seconds; every check and
figure, the numbers meaningless).

bf16 is for GPUs and CPUs with native bf16 (AVX512-BF16/AMX): on the 2-core EPYC dev machines a
1024x512x1536 bf16 matmul took 1.29 s against 13 ms in fp32, so a bf16 run there takes hours.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.jobspec import JobSpec
from engine.launcher import free_port
from engine.training import Trainer

JOB = {
    "name": "bench-engine-step",
    "model": {
        "arch": "llama",
        "num_layers": 4,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_query_groups": 4,
        "seq_length": 256,
    },
    "data": {"source": "synthetic"},
    "training": {"global_batch_size": 4, "micro_batch_size": 4, "train_iters": 1000, "log_interval": 100000},
    "optimizer": {"lr": 1e-4, "lr_decay_style": "constant", "clip_grad": 1.0, "weight_decay": 0.1},
    "resources": {"ranks": 1, "device": "cpu"},
}
SMOKE_MODEL = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "seq_length": 32,
}


class PlainBlock(nn.Module):
    def __init__(self, h: int, heads: int, groups: int, ffn: int, eps: float):
        super().__init__()
        self.heads, self.groups, self.hd = heads, groups, h // heads
        self.attn_norm = nn.RMSNorm(h, eps=eps)
        self.wq = nn.Linear(h, heads * self.hd, bias=False)
        self.wk = nn.Linear(h, groups * self.hd, bias=False)
        self.wv = nn.Linear(h, groups * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=eps)
        self.w1 = nn.Linear(h, ffn, bias=False)
        self.w3 = nn.Linear(h, ffn, bias=False)
        self.w2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        y = self.attn_norm(x)
        q = self.wq(y).view(b, s, self.heads, self.hd)
        k = self.wk(y).view(b, s, self.groups, self.hd)
        v = self.wv(y).view(b, s, self.groups, self.hd)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.heads != self.groups,
        )
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        y = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class PlainLlama(nn.Module):
    def __init__(self, vocab, h, layers, heads, groups, ffn, eps, base):
        super().__init__()
        self.tok = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads, groups, ffn, eps) for _ in range(layers))
        self.norm = nn.RMSNorm(h, eps=eps)
        self.out = nn.Linear(h, vocab, bias=False)
        hd = h // heads
        self.inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))

    def forward(self, ids, labels):
        s = ids.shape[1]
        freqs = torch.outer(torch.arange(s, dtype=torch.float32), self.inv_freq)
        emb = torch.cat([freqs, freqs], -1)[None, :, None, :]
        x = self.tok(ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.reshape(-1))


@torch.no_grad()
def copy_weights(ours: nn.Module, plain: PlainLlama, cfg) -> None:
    """Our fused QKV is per query group [g x (q_per_g + 2) x hd, h]; fc1 is [gate; up]; our
    vocabulary rows past the tokenizer's are padding (never an input, logits masked)."""
    qpg, hd, vocab = cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim, cfg.true_vocab_size
    plain.tok.weight.copy_(ours.embedding.weight[:vocab])
    plain.out.weight.copy_(ours.output_layer.weight[:vocab])
    plain.norm.weight.copy_(ours.decoder.final_layernorm.weight)
    for layer, blk in zip(ours.decoder.layers, plain.blocks, strict=True):
        qkv = layer.self_attention.linear_qkv.weight.view(cfg.num_query_groups, qpg + 2, hd, -1)
        blk.wq.weight.copy_(qkv[:, :qpg].reshape(-1, cfg.hidden_size))
        blk.wk.weight.copy_(qkv[:, qpg].reshape(-1, cfg.hidden_size))
        blk.wv.weight.copy_(qkv[:, qpg + 1].reshape(-1, cfg.hidden_size))
        blk.wo.weight.copy_(layer.self_attention.linear_proj.weight)
        gate, up = layer.mlp.linear_fc1.weight.chunk(2, dim=0)
        blk.w1.weight.copy_(gate)
        blk.w3.weight.copy_(up)
        blk.w2.weight.copy_(layer.mlp.linear_fc2.weight)
        blk.attn_norm.weight.copy_(layer.input_layernorm.weight)
        blk.mlp_norm.weight.copy_(layer.pre_mlp_layernorm.weight)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, 1 round: checks, not figures")
    args = ap.parse_args()
    warmup = 3
    if args.smoke:
        args.steps, args.rounds, warmup = 2, 1, 1
    torch.set_num_threads(os.cpu_count() or 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)

    job = json.loads(json.dumps(JOB))
    job["training"]["precision"] = args.precision
    if args.smoke:
        job["model"].update(SMOKE_MODEL)
    spec = JobSpec.model_validate(job)
    trainer = Trainer(spec)
    cfg = trainer.config
    dtype = cfg.params_dtype
    plain = PlainLlama(
        cfg.true_vocab_size,
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_attention_heads,
        cfg.num_query_groups,
        cfg.ffn_hidden_size,
        cfg.norm_epsilon,
        cfg.rotary_base,
    )
    copy_weights(trainer.model, plain, cfg)
    plain_params = list(plain.parameters())
    master = [p.detach().clone().requires_grad_() for p in plain_params] if dtype != torch.float32 else None
    plain.to(dtype)
    opt = torch.optim.AdamW(
        master or plain_params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True
    )

    rows = torch.stack([trainer.source[i] for i in range(spec.training.micro_batch_size)])
    ids, labels = rows[:, :-1], rows[:, 1:]
    with torch.no_grad():
        ours_loss = float(trainer.model(ids, labels).float().mean())
        plain_loss = float(plain(ids, labels))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if abs(ours_loss - plain_loss) > tol * abs(plain_loss):
        raise SystemExit(
            f"models differ: ours {ours_loss} vs plain {plain_loss}: the ratio would be meaningless"
        )

    def plain_step():
        opt.zero_grad(set_to_none=True)
        for p in plain_params:
            p.grad = None
        loss = plain(ids, labels)
        loss.backward()
        if master is not None:
            for m, p in zip(master, plain_params, strict=True):
                m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(master or plain_params, 1.0, foreach=True)
        opt.step()
        if master is not None:
            with torch.no_grad():
                torch._foreach_copy_(plain_params, master)

    def timed(step) -> float:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        return (time.perf_counter() - start) / args.steps

    for _ in range(warmup):  # warm-up: allocator, kernels, optimizer state
        trainer.train_step()
        plain_step()
    ours_t, plain_t = [], []
    for _ in range(args.rounds):
        ours_t.append(timed(trainer.train_step))
        plain_t.append(timed(plain_step))
    ours_s, plain_s = statistics.median(ours_t), statistics.median(plain_t)
    tokens = spec.training.global_batch_size * cfg.seq_length
    model = f"llama-{cfg.num_layers}L-h{cfg.hidden_size}-s{cfg.seq_length}-b{spec.training.global_batch_size}"
    base = {"bench": "engine_step", "precision": args.precision, "model": model}
    print(json.dumps({**base, "figure": "first_loss_abs_diff", "value": abs(ours_loss - plain_loss)}))
    print(
        json.dumps(
            {
                **base,
                "figure": "plain_step_s",
                "value": round(plain_s, 4),
                "tokens_per_s": round(tokens / plain_s),
            }
        )
    )
    print(
        json.dumps(
            {
                **base,
                "figure": "ours_step_s",
                "value": round(ours_s, 4),
                "tokens_per_s": round(tokens / ours_s),
            }
        )
    )
    print(
        json.dumps(
            {**base, "figure": "ratio_ours_over_plain", "value": round(ours_s / plain_s, 3), "target": 1.05}
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
