"""The data-parallel buffers: buckets are reduced during backward (not after it), and only after a
parameter's last microbatch; the averaged result equals the single-process gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.distributed.data_parallel import DataParallel
from engine.launcher import spawn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])


def _launch_log(overlap: bool, microbatches: int) -> dict:
    ddp = DataParallel(_model(), dist.group.WORLD, bucket_size=16 * 16 + 16, overlap=overlap)
    log = []
    original = ddp.grad_sync._launch  # the level's gradient strategy (sharding.WholeGrads)

    def record(dp, bucket):
        waiting = sum(len(b.flight.pending) for b in ddp.buckets)
        log.append({"waiting_params": waiting, "backward_done": in_backward[0] is False})
        original(dp, bucket)

    ddp.grad_sync._launch = record
    in_backward = [None]
    ddp.start_step(microbatches)
    g = torch.Generator().manual_seed(dist.get_rank())
    inputs = [torch.randn(4, 16, generator=g) for _ in range(microbatches)]
    for x in inputs:
        in_backward[0] = True
        (ddp(x).pow(2).mean() / microbatches).backward()
        in_backward[0] = False
    ddp.finish_grad_sync()
    grads = [p.main_grad.clone() for p in ddp.module.parameters()]
    return {"log": log, "grads": grads, "inputs": inputs, "buckets": len(ddp.buckets)}


def test_buckets_reduce_during_the_last_backward_only():
    results = spawn(_launch_log, 2, (True, 3))
    r0 = results[0]
    assert r0["buckets"] == 6, "one bucket per layer with this bucket size"
    launches = r0["log"]
    assert len(launches) == 6
    assert all(not e["backward_done"] for e in launches), "every bucket launched inside a backward pass"
    assert launches[0]["waiting_params"] > 0, "the first bucket went out while other params still waited"

    # Averaged over ranks and microbatches = the gradient of the mean loss over all 2 x 3 inputs.
    model = _model()
    everything = [x for r in results for x in r["inputs"]]
    for x in everything:
        (model(x).pow(2).mean() / len(everything)).backward()
    for p, g in zip(model.parameters(), r0["grads"], strict=True):
        assert torch.allclose(p.grad, g, atol=1e-6), float((p.grad - g).abs().max())


def test_without_overlap_everything_waits_for_finish():
    launches = spawn(_launch_log, 2, (False, 2))[0]["log"]
    assert len(launches) == 6
    assert all(e["backward_done"] and e["waiting_params"] == 0 for e in launches)
