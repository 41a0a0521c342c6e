"""TrainingOptimizer on one process: fp32 master weights under bf16, clipping, decay groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from engine.jobspec import OptimizerSpec
from engine.optimizer.optimizer import TrainingOptimizer


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8, dtype=dtype), nn.LayerNorm(8, dtype=dtype))


def test_bf16_master_weights_keep_updates_bf16_would_round_away():
    """At weight 1.0 bf16's spacing is 2^-7; 20 Adam steps of 1e-4 each move the fp32 master by
    ~2e-3, which a bf16-only optimizer would lose step by step (each step is below half a ulp)."""
    model = _model(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    opt = TrainingOptimizer(model, OptimizerSpec(lr=1e-4, weight_decay=0.0, clip_grad=0.0))
    assert opt.use_master and all(m.dtype == torch.float32 for m in opt.main_params)
    for _ in range(20):
        opt.zero_grad()
        model(torch.ones(2, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        opt.step()
    master = opt.main_params[0].detach()
    moved = float((1.0 - master).abs().mean())
    assert 1.5e-3 < moved < 2.5e-3, moved
    assert torch.equal(model[0].weight, master.to(torch.bfloat16)), "model holds the rounded master"

    naive = _model(torch.bfloat16)
    with torch.no_grad():
        naive[0].weight.fill_(1.0)
    plain = torch.optim.AdamW(naive.parameters(), lr=1e-4, weight_decay=0.0)
    for _ in range(20):
        plain.zero_grad()
        naive(torch.ones(2, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        plain.step()
    assert float((1.0 - naive[0].weight.detach().float()).abs().mean()) < moved / 2, (
        "control: bf16-only loses updates"
    )


def test_clipping_scales_grads_to_the_limit_and_reports_the_unclipped_norm():
    model = _model(torch.float32)
    opt = TrainingOptimizer(model, OptimizerSpec(lr=1e-12, clip_grad=0.5, weight_decay=0.0))
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).sum().mul(100).backward()
    expected = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    norm = opt.step()
    assert norm == pytest.approx(expected, rel=1e-5)
    clipped = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    assert clipped == pytest.approx(0.5, rel=1e-4)


def test_weight_decay_applies_to_matrices_only():
    model = _model(torch.float32)
    opt = TrainingOptimizer(model, OptimizerSpec(lr=0.1, weight_decay=0.5, clip_grad=0.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # zero grads: only decoupled weight decay can move anything
    after = dict(model.named_parameters())
    assert torch.allclose(after["0.weight"], before["0.weight"] * (1 - 0.1 * 0.5))
    for name in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(after[name], before[name]), name
