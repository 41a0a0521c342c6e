"""LoRA checkpoints hold the adapters and their optimizer state, nothing of the frozen base; a
resume takes the base from where it started (model.init_from, or the seed) and continues exactly,
on another layout too; a checkpoint refuses a different base, naming both."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from engine.checkpointing import raw_io
from engine.checkpointing.backends import open_storage
from engine.checkpointing.commit import open_checkpoint, resolve_checkpoint
from engine.launcher import RankFailure, spawn
from tests.engine import hf_harness as h
from tests.engine.parallel_harness import assert_continues, job, run_job, train_until
from tests.engine.test_lora_peft import LLAMA, VOCAB

LORA = {"lora": {"rank": 4, "alpha": 8, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}}


def saved_keys(path) -> list[str]:
    """Every tensor key of the newest committed checkpoint under `path` (a job's root)."""
    import tempfile
    from pathlib import Path

    storage = open_storage(str(path))
    root, iteration = resolve_checkpoint(storage, "")
    with tempfile.TemporaryDirectory() as cache:
        opened = open_checkpoint(storage, root, iteration, Path(cache), check_now=[raw_io.METADATA])
        return sorted(raw_io.RawStorageReader(opened).read_metadata().state_dict_metadata)


def test_resume_on_another_layout_continues_exactly(tmp_path):
    """TP=2 + SP saves at step 2; one rank resumes and takes steps 3-4 as the uninterrupted run."""
    reference = run_job(job(1, model=LORA, training={"train_iters": 4}, optimizer={"lr": 1e-2}))
    checkpoint = {"path": str(tmp_path), "interval": 2}
    first = job(
        2, model=LORA, training={"train_iters": 4}, optimizer={"lr": 1e-2}, checkpoint=checkpoint,
        parallel={"tensor": 2, "sequence_parallel": True},
    )
    spawn(train_until, 2, (first, 2), timeout_s=240)
    keys = saved_keys(tmp_path / "equiv")
    tensors = [k for k in keys if k.startswith(("model/", "optim/"))]
    assert tensors and all(".lora." in k for k in tensors), [k for k in tensors if ".lora." not in k]
    assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in keys)
    second = job(1, model=LORA, training={"train_iters": 4}, optimizer={"lr": 1e-2}, checkpoint=checkpoint)
    got = spawn(train_until, 1, (second, 4), timeout_s=240)[0]
    assert got["start"] == 2
    assert_continues(got["losses"], reference["losses"], first_iteration=2)


@pytest.fixture(scope="module")
def two_bases(tmp_path_factory):
    """Two tiny Llamas with the same config.json and different weights."""
    first, second = tmp_path_factory.mktemp("base-a"), tmp_path_factory.mktemp("base-b")
    h.save_tiny(first, LlamaConfig, LlamaForCausalLM, seed=0, **LLAMA)
    h.save_tiny(second, LlamaConfig, LlamaForCausalLM, seed=1, **LLAMA)
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()
    return first, second


def hf_lora_job(folder, ckpt, ranks: int = 1) -> dict:
    return h.job(
        folder, ranks, model=LORA, training={"train_iters": 4}, optimizer={"lr": 1e-2},
        checkpoint={"path": str(ckpt), "interval": 2},
    )


def test_base_comes_back_from_init_from_and_a_different_base_fails(two_bases, tmp_path):
    first, second = two_bases
    whole = spawn(h.train_then_logits, 1, (hf_lora_job(first, tmp_path / "whole"), VOCAB), timeout_s=240)[0]
    spawn(h.train_then_logits, 1, (hf_lora_job(first, tmp_path / "cut"), VOCAB, 2), timeout_s=240)
    # DP=2 resumes: the base is imported again (the checkpoint has none), the adapters loaded.
    resumed = spawn(h.train_then_logits, 2, (hf_lora_job(first, tmp_path / "cut", 2), VOCAB), timeout_s=240)[0]
    assert resumed["imported"]
    assert_continues(resumed["losses"], whole["losses"], first_iteration=2)
    mine, theirs = resumed["logits"][..., :VOCAB], whole["logits"][..., :VOCAB]  # past it: padding, -inf
    assert float((mine - theirs).abs().max()) < 1e-5 * float(theirs.abs().max())
    with pytest.raises(RankFailure, match=rf"trained on {first} \(sha256 [0-9a-f]{{64}}\), but this job's base is {second}"):
        spawn(h.train_then_logits, 1, (hf_lora_job(second, tmp_path / "cut"), VOCAB), timeout_s=240)


def test_folder_digest_sees_the_weights(two_bases):
    from engine.hf.base_record import folder_digest

    first, second = two_bases
    assert folder_digest(str(first)) != folder_digest(str(second))
    assert folder_digest(str(first)) == folder_digest(str(first) + "/")  # same folder, same digest


def test_in_memory_snapshot_of_a_lora_job_restores_bitwise():
    """The in-memory snapshot (checkpoint.local_interval) of a LoRA job on DP=2 with ZeRO-1: a
    fresh trainer restored from it takes the same steps, bitwise."""
    from tests.engine.test_memory_snapshot import _roundtrip

    spec = job(2, model=LORA, training={"train_iters": 4}, optimizer={"lr": 1e-2}, parallel={"distributed_optimizer": True})
    for result in spawn(_roundtrip, 2, (spec,), timeout_s=240):
        assert result["resumed_at"] == 2
        assert result["losses"] == result["expected"]
        assert result["same_weights"]
