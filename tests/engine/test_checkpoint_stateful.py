"""The checkpointer saves and restores whatever named `Stateful` parts it is given, and nothing else.

One 2-rank job (TP 2, so model and optimizer parts hold DTensors and strided `#k` pieces) trains a
step and is checkpointed together with a part the engine knows nothing about; that part comes
back on resume, a checkpointer without it (or with a part that was never saved) refuses to load
with an error naming the part, and the trainer's own parts still write exactly the keys they
always wrote (shard keys under "model/", "optim/", "rng/"; the same manifest meta keys).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine import parallel_state as ps
from engine.checkpointing import raw_io
from engine.checkpointing.checkpointer import Checkpointer, layout_signature
from engine.checkpointing.commit import open_checkpoint
from engine.checkpointing.flat_ranges import FlatRanges
from engine.checkpointing.local_storage import LocalStorage
from engine.checkpointing.stateful import Stateful
from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.training import Trainer
from tests.engine.parallel_harness import job

# The manifest meta keys checkpoints have always had (tools and old checkpoints rely on them).
TRAINER_META = {
    "shard_format",
    "iteration",
    "consumed_samples",
    "adam_step",
    "has_master",
    "layout",
    "scheduler",
    "grad_scaler",
    "job",
    "rerun",
}


class Counter:
    """A part of nobody's: a replicated tensor (a shard entry) and a plain value (meta)."""

    def __init__(self) -> None:
        self.weights = torch.zeros(3)
        self.note = 0

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "counter_note": self.note}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.weights.copy_(state_dict["weights"])
        self.note = state_dict["counter_note"]


class Clash:
    """A part that claims a meta key another part writes."""

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": -1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def _checkpointer(trainer: Trainer, **extra: Stateful) -> Checkpointer:
    return Checkpointer(
        {**trainer.checkpoint_parts(), **extra},
        trainer.spec.checkpoint,
        job_name=trainer.spec.name,
        events=trainer.events,
        layout=layout_signature(trainer.spec.parallel),
    )


def _error(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _local(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, FlatRanges):  # this rank's flat ranges of a global tensor
        return t.local_values()
    return t.to_local() if isinstance(t, DTensor) else t


def _rank(spec_dict: dict) -> dict:
    trainer = Trainer(JobSpec.model_validate(spec_dict))
    trainer.train_step()
    counter = Counter()
    counter.weights += torch.arange(3.0)
    counter.note = 7
    _checkpointer(trainer, counter=counter).save()

    path = spec_dict["checkpoint"]["path"]
    opened = open_checkpoint(LocalStorage(path), spec_dict["name"], 1, Path(tempfile.mkdtemp()))
    keys = set(raw_io.RawStorageReader(opened).read_metadata().state_dict_metadata)

    counter.weights.zero_()
    counter.note = 0
    resumed = _checkpointer(trainer, counter=counter).maybe_resume()
    restored = (counter.weights.tolist(), counter.note)
    not_given = _error(lambda: _checkpointer(trainer).maybe_resume())
    never_saved = _error(lambda: _checkpointer(trainer, counter=Counter(), other=Counter()).maybe_resume())
    clash = _error(lambda: _checkpointer(trainer, clash=Clash()).save())

    # The Stateful contract without the checkpointer: load_state_dict(state_dict()) puts back a
    # copy taken one step earlier (model and optimizer, DTensor pieces included).
    parts = trainer.checkpoint_parts()
    before = {
        name: {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in parts[name].state_dict().items()
        }
        for name in ("model", "optim")
    }
    trainer.train_step()
    moved = max(
        float((_local(v) - _local(parts["model"].state_dict()[k])).abs().max())
        for k, v in before["model"].items()
    )
    for name, state in before.items():
        parts[name].load_state_dict(state)
    diff = 0.0
    for name, state in before.items():
        after = parts[name].state_dict()
        assert after.keys() == state.keys(), (name, after.keys() ^ state.keys())
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                diff = max(diff, float((_local(after[k]) - _local(v)).abs().max()))
            else:
                assert after[k] == v, (name, k, after[k], v)
    ps.destroy_model_parallel()
    return {
        "rank": dist.get_rank(),
        "keys": keys,
        "meta": set(opened.meta),
        "resumed": resumed,
        "restored": restored,
        "not_given": not_given,
        "never_saved": never_saved,
        "clash": clash,
        "moved": moved,
        "round_trip_diff": diff,
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    path = tmp_path_factory.mktemp("stateful")
    spec = job(
        2,
        name="stateful",
        parallel={"tensor": 2},
        training={"global_batch_size": 4, "micro_batch_size": 2, "train_iters": 4},
        checkpoint={"path": str(path)},
    )
    return spawn(_rank, 2, (spec,), timeout_s=240)


def test_an_extra_part_is_saved_and_restored(ranks):
    for r in ranks:
        assert r["resumed"] == 1
        assert r["restored"] == ([0.0, 1.0, 2.0], 7)
        assert "counter/weights" in r["keys"] and "counter_note" in r["meta"]


def test_a_saved_part_missing_from_the_mapping_is_an_error(ranks):
    for r in ranks:
        assert "'counter'" in r["not_given"] and "'counter_note'" in r["not_given"], r["not_given"]
        assert "has no tensors of checkpoint part(s) 'other'" in r["never_saved"], r["never_saved"]
        assert "'iteration'" in r["clash"] and "'clash'" in r["clash"], r["clash"]


def test_the_trainers_parts_keep_the_checkpoint_format(ranks):
    for r in ranks:
        assert r["meta"] == TRAINER_META | {"counter_note"}
        assert {k.split("/", 1)[0] for k in r["keys"]} == {"model", "optim", "rng", "counter"}
        tp = r["rank"]  # TP 2 on 2 ranks
        assert f"rng/pp0-tp{tp}-cp0-dp0/default" in r["keys"]
        assert {"model/embedding.weight", "optim/embedding.weight/exp_avg"} <= r["keys"]
        # SwiGLU's gate|up, one key per chunk
        assert "model/decoder.layers.1.mlp.linear_fc1.weight#1" in r["keys"]
        assert "optim/decoder.layers.1.mlp.linear_fc1.weight/exp_avg_sq#1" in r["keys"]


def test_load_state_dict_of_state_dict_round_trips(ranks):
    for r in ranks:
        assert r["moved"] > 0  # the step in between changed the weights
        assert r["round_trip_diff"] == 0.0
