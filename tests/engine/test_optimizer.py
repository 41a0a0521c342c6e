"""TrainingOptimizer on one process: fp32 master weights under bf16, clipping, decay groups, and
fp16 loss scaling (skip on overflow, lower the scale, recover)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from engine.distributed.data_parallel import DataParallel
from engine.jobspec import OptimizerSpec
from engine.optimizer.grad_scaler import DynamicGradScaler
from engine.optimizer.optimizer import TrainingOptimizer


def _model(dtype: torch.dtype) -> DataParallel:
    torch.manual_seed(0)
    return DataParallel(nn.Sequential(nn.Linear(8, 8, dtype=dtype), nn.LayerNorm(8, dtype=dtype)), None)


def _optimizer(ddp: DataParallel, scaler: DynamicGradScaler | None = None, **spec) -> TrainingOptimizer:
    return TrainingOptimizer([ddp], OptimizerSpec(**spec), norm_group=None, grad_scaler=scaler)


def _backward(ddp: DataParallel, x: torch.Tensor, scale: float = 1.0) -> None:
    ddp.start_step(1)
    (ddp(x).float().pow(2).sum() * scale).backward()
    ddp.finish_grad_sync()


def test_bf16_master_weights_keep_updates_bf16_would_round_away():
    """At weight 1.0 bf16's spacing is 2^-7; 20 Adam steps of 1e-4 each move the fp32 master by
    ~2e-3, which a bf16-only optimizer loses step by step (each step is below half a ulp)."""
    ddp = _model(torch.bfloat16)
    with torch.no_grad():
        ddp.module[0].weight.fill_(1.0)
    opt = _optimizer(ddp, lr=1e-4, weight_decay=0.0, clip_grad=0.0)
    assert all(m.dtype == torch.float32 for m in opt.main_params)
    assert ddp.module[0].weight.main_grad.dtype == torch.float32, "grads accumulate in fp32"
    for _ in range(20):
        _backward(ddp, torch.ones(2, 8, dtype=torch.bfloat16))
        opt.step()
    master = opt.main_params[[id(p) for p, _, _ in opt.segments].index(id(ddp.module[0].weight))]
    moved = float((1.0 - master).abs().mean())
    assert 1.5e-3 < moved < 2.5e-3, moved
    weight = ddp.module[0].weight.detach()
    assert torch.equal(weight.view(-1), master.to(torch.bfloat16)), "model holds the rounded master"

    torch.manual_seed(0)
    naive = nn.Sequential(nn.Linear(8, 8, dtype=torch.bfloat16))
    with torch.no_grad():
        naive[0].weight.fill_(1.0)
    plain = torch.optim.AdamW(naive.parameters(), lr=1e-4, weight_decay=0.0)
    for _ in range(20):
        plain.zero_grad()
        naive(torch.ones(2, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        plain.step()
    assert float((1.0 - naive[0].weight.detach().float()).abs().mean()) < moved / 2, (
        "control: bf16-only loses"
    )


def test_clipping_scales_grads_to_the_limit_and_reports_the_unclipped_norm():
    ddp = _model(torch.float32)
    opt = _optimizer(ddp, lr=1e-12, clip_grad=0.5, weight_decay=0.0)
    _backward(ddp, torch.randn(4, 8), scale=100.0)
    params = list(ddp.module.parameters())
    expected = math.sqrt(sum(float(p.main_grad.pow(2).sum()) for p in params))
    result = opt.step()
    assert result.grad_norm == pytest.approx(expected, rel=1e-5)
    clipped = math.sqrt(sum(float(p.main_grad.pow(2).sum()) for p in params))
    assert clipped == pytest.approx(0.5, rel=1e-4)


def test_weight_decay_applies_to_matrices_only():
    ddp = _model(torch.float32)
    opt = _optimizer(ddp, lr=0.1, weight_decay=0.5, clip_grad=0.0)
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    ddp.start_step(1)  # zero grads: only decoupled weight decay can move anything
    opt.step()
    after = dict(ddp.module.named_parameters())
    assert torch.allclose(after["0.weight"], before["0.weight"] * (1 - 0.1 * 0.5))
    for name in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(after[name], before[name]), name


def test_fp16_overflow_skips_the_step_lowers_the_scale_and_recovers():
    ddp = _model(torch.float16)
    scaler = DynamicGradScaler(initial_scale=1024.0, hysteresis=1, growth_interval=2)
    opt = _optimizer(ddp, scaler, lr=1e-2, weight_decay=0.0)
    x = torch.randn(2, 8, dtype=torch.float16)

    _backward(ddp, x, scale=scaler.scale)
    weight = ddp.module[0].weight
    weight.main_grad[0, 0] = float("inf")  # an overflowing step
    before = weight.detach().clone()
    result = opt.step()
    assert result.skipped and math.isnan(result.grad_norm)
    assert torch.equal(weight.detach(), before), "a skipped step must not touch the weights"
    assert scaler.scale == 512.0

    for expected_scale in (512.0, 1024.0):  # two clean steps: the second doubles the scale back
        _backward(ddp, x, scale=scaler.scale)
        result = opt.step()
        assert not result.skipped and math.isfinite(result.grad_norm)
        assert scaler.scale == expected_scale
    assert not torch.equal(weight.detach(), before), "clean steps update the weights"


def test_scaler_hysteresis_tolerates_isolated_overflows():
    scaler = DynamicGradScaler(initial_scale=2.0**16, hysteresis=2, growth_interval=1000)
    scaler.update(True)
    assert scaler.scale == 2.0**16, "first overflow is tolerated"
    scaler.update(True)
    assert scaler.scale == 2.0**15
    with pytest.raises(ValueError, match="growth_factor"):
        DynamicGradScaler(initial_scale=1.0, growth_factor=1.0)
