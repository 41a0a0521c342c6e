"""DataParallel's read-only view for checkpoints (engine/distributed/state_view.py): what it says
at each sharding level on two ranks, and that the checkpoint parts use nothing else of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine.distributed.data_parallel import DataParallel
from engine.distributed.sharding import SHARDING_LEVELS
from engine.launcher import spawn

ROOT = Path(__file__).resolve().parents[2]


def test_checkpoint_parts_read_data_parallelism_only_through_its_view():
    uses = []
    for path in (ROOT / "engine" / "checkpointing").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id.startswith("ddp")
                and node.value.id != "ddp_chunks"
                and node.attr != "checkpoint_view"
            ):
                uses.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not uses, "read DataParallel through checkpoint_view():\n" + "\n".join(uses)


def _view(level: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DataParallel(model, dist.group.WORLD, sharding=level, bucket_size=10)
    view = ddp.checkpoint_view()
    holdings = [view.holding(p) for p in model.parameters()]
    world = dist.group.WORLD
    out = {
        "sharded": view.params_sharded,
        "shards": [s.tensor.numel() for s in view.shards],
        "buckets": [b.shard_numel for b in ddp.buckets],
        "in_shard": {h.in_shard for h in holdings},
        "values": {h.value_replicas is world for h in holdings},
        "state": {h.state_group is world for h in holdings},
        "state_replicas": {h.state_replicas is world for h in holdings},
        "unheld": view.holding(torch.zeros(1)) is None,
    }
    view.gather_whole()  # ZeRO-3: whole again, with the values they started from
    out["whole"] = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a load wrote whole values into the parameters
    view.scatter_loaded()
    view.refresh()  # drop the gathered copies: the next use gathers the loaded shards
    view.gather_whole()
    out["loaded"] = all(torch.equal(a + 1.0, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
    return out


@pytest.mark.parametrize("level", SHARDING_LEVELS)
def test_what_the_view_says_at_each_level(level):
    got = spawn(_view, 2, (level,))[1]
    zero3 = level == "optim_grads_params"
    assert got["sharded"] is zero3 and got["in_shard"] == {zero3} and got["unheld"]
    assert got["shards"] == (got["buckets"] if zero3 else [])
    assert got["values"] == {True}, "whole values are alike over the DP group"
    assert got["state"] == {level != "none"}, "optimizer state split over DP once any level shards it"
    assert got["state_replicas"] == {level == "none"}, "unsharded state is alike over DP; shards are one rank's"
    assert got["whole"] and got["loaded"]
