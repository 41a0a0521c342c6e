"""The data pipeline inside training: exact resume across a change of data-parallel size and micro
batch size (the token ids fed, compared with an uninterrupted run), and evaluation on the
validation split that agrees across layouts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.data.preprocess import preprocess
from engine.data.sources import SHIPPED_CORPUS, TokenSource
from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.train_loop import train_rank
from engine.training import Trainer
from tests.engine.parallel_harness import LOSS_RTOL, job


class RecordingSource(TokenSource):
    """Passes samples through and notes (iteration being trained, sample index, token ids)."""

    def __init__(self, trainer: Trainer, inner):
        self.trainer, self.inner, self.seen = trainer, inner, []

    def __getitem__(self, index: int) -> torch.Tensor:
        sample = self.inner[index]
        self.seen.append((self.trainer.iteration + 1, index, sample.tolist()))
        return sample


def fed_tokens(spec_dict: dict, stop_at: int) -> list | None:
    """Train to `stop_at` (resuming from the job's checkpoints) and return, on rank 0, every
    (iteration, sample index, token ids) any rank was fed."""
    trainer = Trainer(JobSpec.model_validate(spec_dict))
    trainer.source = RecordingSource(trainer, trainer.source)
    try:
        while trainer.iteration < stop_at:
            trainer.train_step()
            trainer.save_checkpoint_if_due()
        trainer.checkpointer.wait()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, trainer.source.seen)
    finally:
        ps.destroy_model_parallel()
    return sorted(x for seen in everyone for x in seen) if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def indexed_corpus(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("data") / "stdlib"
    preprocess([SHIPPED_CORPUS], "byte", prefix, progress=False)
    return str(prefix)


def test_resume_on_another_dp_size_and_micro_batch_feeds_the_uninterrupted_runs_tokens(
    tmp_path, indexed_corpus
):
    def spec(ranks: int, mbs: int, name: str) -> dict:
        return job(
            ranks,
            name=name,
            data={"source": "indexed", "path": indexed_corpus, "split": "98,2,0"},
            training={"global_batch_size": 8, "micro_batch_size": mbs, "train_iters": 6},
            checkpoint={"path": str(tmp_path / name), "interval": 3},
        )

    reference = spawn(fed_tokens, 2, (spec(2, 2, "straight"), 6))[0]
    first = spawn(fed_tokens, 2, (spec(2, 2, "resized"), 3))[0]
    # Resumed from iteration 3 on one rank with micro batch 4: twice the microbatches per rank.
    second = spawn(fed_tokens, 1, (spec(1, 4, "resized"), 6))[0]
    assert [x[:2] for x in reference] == [(it, i) for it in range(1, 7) for i in range((it - 1) * 8, it * 8)]
    assert first + second == reference


def test_evaluation_gives_the_same_validation_loss_on_every_layout():
    base = {
        "data": {"source": "text", "split": "90,10,0"},
        "training": {"train_iters": 4, "eval_interval": 2, "eval_iters": 2, "global_batch_size": 4},
    }
    single = spawn(train_rank, 1, (job(1, **base), None, True))[0]
    valid = {r["iteration"]: r["valid_loss"] for r in single if r["valid_loss"] is not None}
    assert sorted(valid) == [2, 4] and valid[4] < valid[2]
    assert single[1]["valid_ppl"] == pytest.approx(2.718281828 ** valid[2], rel=1e-6)
    for parallel in ({"pipeline": 2}, {"tensor": 2}):
        records = spawn(train_rank, 2, (job(2, parallel=parallel, **base), None, True))[0]
        got = {r["iteration"]: r["valid_loss"] for r in records if r["valid_loss"] is not None}
        assert got == pytest.approx(valid, rel=LOSS_RTOL), parallel
