"""Run a job for a few iterations on N spawned ranks and return what the equivalence tests compare:
per-iteration losses, and the full (unsharded) gradients and parameters of the last iteration.

Gradient clipping is off in these jobs so the gradients compared are the raw reduced ones.
Adam's eps is 1e-6 rather than 1e-8: the key bias (GPT-2 style) has a mathematically zero
gradient (softmax ignores a shift shared by all keys), measured at ~1e-11, and with eps 1e-8
Adam turns that round-off into steps of ~1e-2 x lr that differ between any two reduction
orders. With 1e-6 such noise moves nothing; every real gradient here is far above it.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.checkpointing import checkpointer as checkpointer_module
from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.parallel_placement import placement_of
from engine.tensor_parallel import unshard
from engine.tensor_parallel.mappings import all_gather_along
from engine.training import Trainer

BASE_JOB = {
    "name": "equiv",
    "model": {
        "arch": "llama",
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "seq_length": 32,
    },
    "data": {"source": "text"},
    "training": {"global_batch_size": 4, "micro_batch_size": 2, "train_iters": 5, "seed": 7},
    "optimizer": {"lr": 1e-3, "clip_grad": 0.0, "lr_warmup_iters": 1, "adam_eps": 1e-6},
}


def job(ranks: int = 1, **sections) -> dict:
    """BASE_JOB with sections merged one level deep, e.g. job(2, parallel={"tensor": 2})."""
    spec = copy.deepcopy(BASE_JOB)
    for key, value in sections.items():
        if isinstance(value, dict):
            spec.setdefault(key, {}).update(value)
        else:
            spec[key] = value
    spec["resources"] = {"ranks": ranks, "device": "cpu"}
    return spec


def _full(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    dim = placement_of(param).tp_dim
    if dim is None or ps.get_tensor_model_parallel_world_size() == 1:
        return t.detach().float().clone()
    tp = ps.get_tensor_model_parallel_world_size()
    gathered = all_gather_along(t.detach().float().contiguous(), 0, ps.get_tensor_model_parallel_group())
    return unshard(list(gathered.chunk(tp, dim=0)), dim, placement_of(param).tp_stride)


def _train_and_collect(spec_dict: dict) -> dict:
    trainer = Trainer(JobSpec.model_validate(spec_dict))
    steps = [trainer.train_step() for _ in range(spec_dict["training"]["train_iters"])]
    # ZeRO-1: main_grad is valid in this rank's shard only. Sharded gradients (optim_grads and
    # up) are all-gathered from their shards; sharded parameters are gathered whole.
    sharded_grads = trainer.spec.parallel.data_parallel_sharding == "optim"
    grads, params, copies = {}, {}, {}
    for chunk, ddp in zip(trainer.model_chunks, trainer.ddp_chunks, strict=True):
        ddp.gather_all_params()
        whole_grads = {} if sharded_grads else ddp.unsharded_grads()
        for name, p in chunk.named_parameters():
            if not p.requires_grad:  # frozen (a LoRA job's base): no gradient, never stepped
                continue
            key = chunk.global_param_name(name)
            if placement_of(p).tied_copy:
                copies[key] = _full(p, p)
                continue
            params[key] = _full(p, p)
            if not sharded_grads:
                grads[key] = _full(whole_grads[id(p)], p)
    if ps.get_grid().ep > 1:  # MoE: each expert-parallel rank holds its own experts
        mine = tuple({k: v for k, v in d.items() if ".experts." in k} for d in (grads, params))
        peers = [None] * ps.get_grid().ep
        dist.all_gather_object(peers, mine, group=ps.get_group("ep"))
        for g, p in peers:
            grads.update(g)
            params.update(p)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        stages = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, (grads, params, copies), group=ps.get_group("pp"))
        grads, params, copies = {}, {}, {}
        for g, p, c in stages:
            grads.update(g)
            params.update(p)
            copies.update(c)
    tied_copy_diff = max((float((t - params[k]).abs().max()) for k, t in copies.items()), default=None)
    ps.destroy_model_parallel()
    result = {
        "losses": [m.loss for m in steps],
        "mtp_losses": [m.mtp_loss for m in steps],
        "grad_norms": [m.grad_norm for m in steps],
        "skipped": [m.skipped for m in steps],
        "global_batch_sizes": [m.global_batch_size for m in steps],
        "loss_scales": [m.loss_scale for m in steps],
        "grads": grads if not sharded_grads else None,
        "params": params,
        "tied_copy_diff": tied_copy_diff,
    }
    return result if dist.get_rank() == 0 else {}


def run_job(spec_dict: dict) -> dict:
    return spawn(_train_and_collect, spec_dict["resources"]["ranks"], (spec_dict,), timeout_s=240)[0]


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest |a-b| / (max|b| + 1e-8) over tensors with the same name, and which name."""
    assert a.keys() == b.keys(), set(a) ^ set(b)
    worst, where = 0.0, ""
    for k in a:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
        d = float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-8))
        if d > worst:
            worst, where = d, k
    return worst, where


LOSS_RTOL = 1e-5  # per-iteration loss and global grad norm, relative
TENSOR_RTOL = 1e-4  # last-step gradients and final parameters, relative to each tensor's largest value


def assert_same_training(got: dict, ref: dict) -> None:
    """Same losses and grad norms every iteration, same gradients (where each rank holds them
    whole) and parameters at the end, within the fp32 tolerances above."""
    assert len(got["losses"]) == len(ref["losses"]) > 0
    for name in ("losses", "grad_norms"):
        for it, (a, b) in enumerate(zip(got[name], ref[name], strict=True)):
            assert a == pytest.approx(b, rel=LOSS_RTOL), f"iteration {it + 1}: {name} {a} vs reference {b}"
    if got["grads"] is not None:
        diff, where = max_rel_diff(got["grads"], ref["grads"])
        assert diff < TENSOR_RTOL, f"gradient of {where} differs by {diff:.2e} (relative)"
    diff, where = max_rel_diff(got["params"], ref["params"])
    assert diff < TENSOR_RTOL, f"parameter {where} differs by {diff:.2e} (relative) at the end"


def train_until(spec_dict: dict, stop_at: int, kill_rank_during_save_at: int | None = None) -> dict:
    """Rank function: build the job (resuming as it says), train to iteration `stop_at` saving
    as checkpoint.interval says, always commit a checkpoint at `stop_at`. Optionally rank 1 dies
    (os._exit) in the middle of the save of iteration `kill_rank_during_save_at`."""
    if kill_rank_during_save_at is not None:

        def die(iteration: int) -> None:
            if iteration == kill_rank_during_save_at and dist.get_rank() == 1:
                os._exit(1)

        checkpointer_module._FAULT_HOOK = die
    trainer = Trainer(JobSpec.model_validate(spec_dict))
    start = trainer.iteration
    losses = []
    while trainer.iteration < stop_at:
        losses.append(trainer.train_step().loss)
        if not trainer.save_checkpoint_if_due() and trainer.iteration == stop_at:
            trainer.checkpointer.save()
    trainer.checkpointer.wait()
    ps.destroy_model_parallel()
    return {"start": start, "losses": losses} if dist.get_rank() == 0 else {}


def assert_continues(losses: list[float], reference: list[float], first_iteration: int = 0) -> None:
    """`losses` are iterations first_iteration+1, ... of a run that resumed from a checkpoint:
    each within LOSS_RTOL of the uninterrupted run's."""
    assert len(losses) == len(reference) - first_iteration, (len(losses), len(reference), first_iteration)
    for it, (a, b) in enumerate(zip(losses, reference[first_iteration:], strict=True)):
        assert a == pytest.approx(b, rel=LOSS_RTOL), (
            f"iteration {first_iteration + it + 1}: {a} vs uninterrupted {b}"
        )
