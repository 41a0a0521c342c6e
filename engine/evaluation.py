"""Validation: the token cross entropy over the validation split's first `training.eval_iters`
global batches, the same batches every time, so evaluations compare across the run and across
resumes. The mean is over every label token that is not IGNORE_INDEX, as in training.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.objective import label_tokens, summed_token_loss
from engine.step_batches import StepBatches


@torch.no_grad()
def evaluate(
    model_chunks,
    batches: StepBatches,
    source,
    *,
    eval_iters: int,
    global_batch_size: int,
    num_microbatches: int,
    replicas: int,
    device: torch.device,
) -> dict[str, float]:
    """Validation loss and perplexity; a collective (over the pipeline and DP x CP = `replicas`)."""
    runner, n = batches.pipeline, num_microbatches
    for chunk in model_chunks:
        chunk.eval()
    total = torch.zeros(2, dtype=torch.float32, device=device)  # loss sum, label tokens
    for k in range(eval_iters):
        step = batches.read(source, k * global_batch_size, n)
        if runner is None or runner.has_last:
            total[1] += label_tokens([b.labels for b in step])
        if runner is None:
            for tokens, labels, packed, inputs in step:
                logits = model_chunks[0](tokens, packed_seq_params=packed, **(inputs or {}))
                total[0] += summed_token_loss(logits, labels)
            continue
        tokens, labels, packed, inputs = batches.pipeline_inputs(step)
        for loss in runner.evaluate(n, tokens, labels, summed_token_loss, packed=packed, inputs=inputs):
            total[0] += loss
    if runner is not None:  # only the last stage has losses and counts
        dist.all_reduce(total, group=ps.get_group("pp"))
    if replicas > 1:
        dist.all_reduce(total, group=ps.get_group("dp_cp"))
    loss = float(total[0]) / max(float(total[1]), 1.0)
    return {"valid_loss": loss, "valid_ppl": math.exp(min(loss, 50.0))}
