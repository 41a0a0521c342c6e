"""Checkpoints as a job lives through them: async saves, a rank dying mid-save, a corrupted
shard, and the same save/reshard/resume path on a real S3-compatible server.

Loss tolerance: the harness's LOSS_RTOL (1e-5) relative to the uninterrupted run.
"""

from __future__ import annotations

import os

import pytest

from engine.checkpointing.backends import open_storage
from engine.checkpointing.commit import committed_iterations, latest_checkpoint
from engine.launcher import RankFailure, spawn
from tests.engine.parallel_harness import assert_continues, job, train_until

MODEL = {"num_layers": 2}
TRAINING = {"global_batch_size": 4, "micro_batch_size": 1, "train_iters": 8}


def _spec(ranks: int, path: str, **checkpoint) -> dict:
    return job(
        ranks,
        name="job",
        model=MODEL,
        training=TRAINING,
        checkpoint={"path": path, "interval": 2, **checkpoint},
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return spawn(train_until, 1, (_spec(1, str(tmp_path_factory.mktemp("ref"))), 8))[0]["losses"]


def test_async_saves_commit_and_resume(reference, tmp_path):
    first = spawn(train_until, 2, (_spec(2, str(tmp_path), async_save=True), 6))[0]
    storage = open_storage(str(tmp_path))
    assert committed_iterations(storage, "job") == [2, 4, 6]
    second = spawn(train_until, 2, (_spec(2, str(tmp_path), async_save=True), 8))[0]
    assert second["start"] == 6
    assert_continues(first["losses"] + second["losses"], reference, 0)


def test_rank_killed_during_async_save_leaves_the_previous_checkpoint(reference, tmp_path):
    with pytest.raises(RankFailure, match="rank 1"):
        spawn(train_until, 2, (_spec(2, str(tmp_path), async_save=True), 8, 6), timeout_s=120)
    storage = open_storage(str(tmp_path))
    assert latest_checkpoint(storage, "job") == 4, "the interrupted save of iteration 6 must not be latest"
    assert 6 not in committed_iterations(storage, "job")
    resumed = spawn(train_until, 2, (_spec(2, str(tmp_path)), 8))[0]
    assert resumed["start"] == 4
    assert_continues(resumed["losses"], reference, 4)


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_shard_names_the_shard_and_auto_resume_falls_back(reference, tmp_path):
    spawn(train_until, 2, (_spec(2, str(tmp_path)), 6))
    shard = tmp_path / "job" / "iter_0000006" / "__1_0.distcp"
    _flip_a_byte(shard)

    explicit = _spec(1, str(tmp_path / "other"), resume_from=str(tmp_path / "job" / "iter_0000006"))
    with pytest.raises(RankFailure, match="__1_0.distcp"):
        spawn(train_until, 1, (explicit, 8))

    resumed = spawn(train_until, 2, (_spec(2, str(tmp_path)), 8))[0]
    assert resumed["start"] == 4, "auto resume falls back to the previous committed checkpoint"
    assert_continues(resumed["losses"], reference, 4)


def test_s3_save_on_tp2_resume_on_one_rank(reference, s3_bucket, s3_env):
    """Against moto's S3 server in its own process: shards are uploaded, the manifest and
    `latest` land last, and a different layout resumes from the bucket."""
    env = {
        k: os.environ[k]
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
        if k in os.environ
    }
    uri = f"s3://{s3_bucket}/runs"
    first_spec = _spec(2, uri, endpoint_url=s3_env)
    first_spec["parallel"] = {"tensor": 2}
    first = spawn(train_until, 2, (first_spec, 4), env=env)[0]
    storage = open_storage(uri, endpoint_url=s3_env)
    assert committed_iterations(storage, "job") == [2, 4]
    assert (
        storage.exists("job/iter_0000004/manifest.json") and storage.get_bytes("job/latest").strip() == b"4"
    )
    second = spawn(train_until, 1, (_spec(1, uri, endpoint_url=s3_env), 8), env=env)[0]
    assert second["start"] == 4
    assert_continues(first["losses"] + second["losses"], reference, 0)


def test_rng_state_comes_back_on_the_same_layout(tmp_path):
    """With dropout, iterations 5-8 after a same-layout resume equal the uninterrupted run's only
    if every RNG stream (default and TP tracker) was restored; a different layout reseeds, which
    the control shows gives different losses."""
    dropout = {**MODEL, "hidden_dropout": 0.1, "attention_dropout": 0.1}

    def spec(ranks: int, path, parallel: dict | None = None) -> dict:
        out = job(
            ranks, name="job", model=dropout, training=TRAINING, checkpoint={"path": str(path), "interval": 4}
        )
        out["parallel"] = parallel or {}
        return out

    tp2 = {"tensor": 2, "sequence_parallel": True}
    uninterrupted = spawn(train_until, 2, (spec(2, tmp_path / "a", tp2), 8))[0]["losses"]
    spawn(train_until, 2, (spec(2, tmp_path / "b", tp2), 4))
    resumed = spawn(train_until, 2, (spec(2, tmp_path / "b", tp2), 8))[0]
    assert resumed["start"] == 4
    assert resumed["losses"] == uninterrupted[4:], "same layout: bitwise the same dropout masks"

    other_layout = job(
        2,
        name="job2",
        model=dropout,
        training=TRAINING,
        checkpoint={"path": str(tmp_path / "c"), "resume_from": str(tmp_path / "b" / "job" / "iter_0000004")},
    )
    reseeded = spawn(train_until, 2, (other_layout, 8))[0]
    assert reseeded["start"] == 4 and reseeded["losses"] != uninterrupted[4:]
