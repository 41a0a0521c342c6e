"""Tensor-parallel building blocks on real gloo ranks: vocab-parallel cross entropy against torch's,
the communication regions' forward and backward, and the TP-aware RNG tracker."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine import parallel_state as ps
from engine.launcher import spawn
from engine.tensor_parallel import (
    gather_from_sequence_parallel_region,
    get_rng_tracker,
    model_parallel_manual_seed,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)


def _cross_entropy_case(vocab: int, tokens: tuple[int, int]) -> dict:
    ps.initialize_model_parallel(tensor=dist.get_world_size())
    tp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    full = torch.randn(*tokens, vocab, generator=g, dtype=torch.float64).float() * 4
    target = torch.randint(0, vocab, tokens, generator=g)
    weight = torch.rand(tokens, generator=g)  # non-uniform upstream grad

    ref_logits = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction="none").view(tokens)
    (ref * weight).sum().backward()

    shard = full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target)
    (loss * weight).sum().backward()
    ps.destroy_model_parallel()
    return {
        "loss_err": float((loss - ref).abs().max()),
        "grad_err": float((shard.grad - ref_logits.grad.chunk(tp, dim=-1)[rank]).abs().max()),
        "targets_on_rank": int(((target // (vocab // tp)) == rank).sum()),
    }


def test_vocab_parallel_cross_entropy_matches_torch():
    """fp32, tolerance 1e-5 absolute on loss and logits-grad; targets land on both ranks' halves."""
    for result in spawn(_cross_entropy_case, 2, (128, (16, 3))):
        assert result["loss_err"] < 1e-5, result
        assert result["grad_err"] < 1e-5, result
        assert result["targets_on_rank"] > 0, "the case must exercise targets owned by every rank"


def test_vocab_parallel_cross_entropy_four_ranks():
    for result in spawn(_cross_entropy_case, 4, (256, (8, 2))):
        assert result["loss_err"] < 1e-5 and result["grad_err"] < 1e-5, result


def _regions_case() -> dict:
    """Each region's forward and backward checked against the full-tensor computation."""
    ps.initialize_model_parallel(tensor=2)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    full = torch.randn(8, 2, 6, generator=g)
    out = {}

    # scatter to sequence: forward = my chunk; backward gathers the grad of every chunk.
    x = full.clone().requires_grad_()
    y = scatter_to_sequence_parallel_region(x)
    out["seq_scatter_fwd"] = torch.equal(y, full.chunk(2, 0)[rank])
    (y * (rank + 1)).sum().backward()
    expected = torch.cat([torch.full_like(c, r + 1) for r, c in enumerate(full.chunk(2, 0))])
    out["seq_scatter_bwd"] = torch.equal(x.grad, expected)

    # gather from sequence: forward = full; backward reduce-scatters (sum over ranks, my chunk).
    chunk = full.chunk(2, 0)[rank].clone().requires_grad_()
    y = gather_from_sequence_parallel_region(chunk, tensor_parallel_output_grad=True)
    out["seq_gather_fwd"] = torch.equal(y, full)
    (y * (rank + 1)).sum().backward()
    out["seq_gather_bwd"] = torch.equal(chunk.grad, torch.full_like(chunk, 1 + 2))

    # reduce-scatter: forward sums partial tensors and keeps my chunk.
    part = (full * (rank + 1)).requires_grad_()
    y = reduce_scatter_to_sequence_parallel_region(part)
    out["reduce_scatter_fwd"] = torch.allclose(y, (full * 3).chunk(2, 0)[rank])
    y.sum().backward()
    out["reduce_scatter_bwd"] = torch.equal(part.grad, torch.ones_like(full))

    # scatter along the hidden dim.
    x = full.clone().requires_grad_()
    y = scatter_to_tensor_model_parallel_region(x)
    out["tp_scatter_fwd"] = torch.equal(y, full.chunk(2, -1)[rank])
    y.sum().backward()
    out["tp_scatter_bwd"] = torch.equal(x.grad, torch.ones_like(full))
    ps.destroy_model_parallel()
    return out


def test_communication_regions_forward_and_backward():
    for rank, result in enumerate(spawn(_regions_case, 2)):
        failed = [k for k, ok in result.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def _rng_case() -> dict:
    ps.initialize_model_parallel(tensor=2)
    model_parallel_manual_seed(123)
    tracker = get_rng_tracker()
    replicated = F.dropout(torch.ones(64), 0.5)
    with tracker.fork():
        sharded = F.dropout(torch.ones(64), 0.5)
    after_fork = torch.rand(4)
    # The same default-stream draws without the fork in between: forking must not disturb it.
    model_parallel_manual_seed(123)
    F.dropout(torch.ones(64), 0.5)
    no_fork = torch.rand(4)
    ps.destroy_model_parallel()
    return {"replicated": replicated, "sharded": sharded, "after_fork": after_fork, "no_fork": no_fork}


def test_rng_tracker_same_where_replicated_different_where_sharded():
    r0, r1 = spawn(_rng_case, 2)
    assert torch.equal(r0["replicated"], r1["replicated"]), (
        "replicated activations need one mask on all TP ranks"
    )
    assert not torch.equal(r0["sharded"], r1["sharded"]), "TP-sharded activations need a mask per TP rank"
    for r in (r0, r1):
        assert torch.equal(r["after_fork"], r["no_fork"]), "fork() must restore the default stream"
