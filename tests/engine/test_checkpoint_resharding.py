"""Save on one layout, resume on another, continue the uninterrupted run's loss curve.

Reference: one rank trains 8 iterations. Each case trains iterations 1-4 on layout A, commits a
checkpoint, and a new job on layout B resumes it (`checkpoint.resume_from`, or `resume: auto`
for the same job) and trains 5-8. Tolerance: each of the 8 losses within the harness's LOSS_RTOL (1e-5) relative of the
reference (fp32; the checkpoint carries params, Adam moments, schedule and data position
exactly, so only reduction order differs).
"""

from __future__ import annotations

import pytest

from engine.launcher import spawn
from tests.engine.parallel_harness import assert_continues, job, train_until

MODEL = {"num_layers": 4, "num_attention_heads": 4, "num_query_groups": 4}
TRAINING = {"global_batch_size": 8, "micro_batch_size": 1, "train_iters": 8}
MOE = {"num_experts": 4, "top_k": 2, "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}


def run_segment(
    ranks: int, parallel: dict, stop_at: int, path, name: str, resume_from=None, model=MODEL
) -> dict:
    checkpoint = {"path": str(path)}
    if resume_from is not None:
        checkpoint["resume_from"] = str(resume_from)
    spec = job(ranks, name=name, model=model, training=TRAINING, parallel=parallel, checkpoint=checkpoint)
    return spawn(train_until, ranks, (spec, stop_at), timeout_s=240)[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = run_segment(1, {}, 8, tmp_path_factory.mktemp("ref"), "reference")
    assert out["start"] == 0 and len(out["losses"]) == 8
    return out["losses"]


def _assert_continues(first: dict, second: dict, reference: list[float]) -> None:
    assert first["start"] == 0 and second["start"] == 4, (first["start"], second["start"])
    assert_continues(first["losses"] + second["losses"], reference)


@pytest.fixture(scope="module")
def saved_tp2_pp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2pp2")
    out = run_segment(4, {"tensor": 2, "pipeline": 2}, 4, root, "src")
    return root / "src", out


@pytest.mark.parametrize(
    "ranks,parallel",
    [(1, {}), (4, {"tensor": 4}), (4, {"tensor": 2})],
    ids=["to-tp1-pp1", "to-tp4", "to-dp2-tp2"],
)
def test_tp2_pp2_checkpoint_resumes_on_other_layouts(saved_tp2_pp2, reference, tmp_path, ranks, parallel):
    src, first = saved_tp2_pp2
    second = run_segment(ranks, parallel, 8, tmp_path, "dst", resume_from=src)
    _assert_continues(first, second, reference)


@pytest.fixture(scope="module")
def saved_dp2_distributed(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp2zero")
    out = run_segment(2, {"distributed_optimizer": True}, 4, root, "src")
    return root / "src", out


@pytest.mark.parametrize(
    "ranks,parallel",
    [(4, {"distributed_optimizer": True}), (1, {})],
    ids=["to-dp4-distributed", "to-dp1"],
)
def test_distributed_optimizer_checkpoint_resumes_on_other_dp_sizes(
    saved_dp2_distributed, reference, tmp_path, ranks, parallel
):
    src, first = saved_dp2_distributed
    second = run_segment(ranks, parallel, 8, tmp_path, "dst", resume_from=src)
    _assert_continues(first, second, reference)


def test_same_job_resumes_automatically_with_another_micro_batch(reference, tmp_path):
    """`resume: auto` (the default): the second run of the same job continues from its newest
    checkpoint, here on 2 ranks with micro batch 2 instead of 1 rank with micro batch 1."""
    first = run_segment(1, {}, 4, tmp_path, "same")
    spec_training = dict(TRAINING, micro_batch_size=2)
    spec = job(2, name="same", model=MODEL, training=spec_training, checkpoint={"path": str(tmp_path)})
    second = spawn(train_until, 2, (spec, 8), timeout_s=240)[0]
    _assert_continues(first, second, reference)


# --- data-parallel sharding levels (parallel.data_parallel_sharding), both directions ---


@pytest.fixture(scope="module")
def saved_fsdp_dp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp4")
    return root / "src", run_segment(4, {"data_parallel_sharding": "optim_grads_params"}, 4, root, "src")


@pytest.mark.parametrize(
    "ranks,parallel",
    [
        (1, {}),
        (4, {"tensor": 2, "data_parallel_sharding": "optim_grads"}),
        (4, {"data_parallel_sharding": "optim_grads_params", "data_parallel_shard_size": 2}),
    ],
    ids=["to-dp1", "to-tp2-dp2-optim-grads", "to-hsdp-2x2"],
)
def test_fsdp_checkpoint_resumes_on_other_levels_and_layouts(
    saved_fsdp_dp4, reference, tmp_path, ranks, parallel
):
    src, first = saved_fsdp_dp4
    second = run_segment(ranks, parallel, 8, tmp_path, "dst", resume_from=src)
    assert first["start"] == 0 and second["start"] == 4, (first["start"], second["start"])
    assert_continues(first["losses"] + second["losses"], reference)


def test_unsharded_checkpoint_resumes_under_fsdp(reference, tmp_path):
    """The other way round: TP=2 without sharding saves, FSDP on DP=2 x PP=2 continues."""
    first = run_segment(2, {"tensor": 2}, 4, tmp_path / "a", "src")
    parallel = {"pipeline": 2, "data_parallel_sharding": "optim_grads_params"}
    second = run_segment(4, parallel, 8, tmp_path / "b", "dst", resume_from=tmp_path / "a" / "src")
    assert second["start"] == 4
    assert_continues(first["losses"] + second["losses"], reference)


def test_moe_checkpoint_with_sharded_experts_resumes_elsewhere(tmp_path):
    """Experts sharded over expert DP (EP=2 on 4 ranks, optim_grads_params) save; EP=1 on 2 ranks
    without sharding continues, and back: experts sharded again from an unsharded checkpoint."""
    model = {**MODEL, "moe": MOE}
    reference = run_segment(1, {}, 8, tmp_path / "ref", "reference", model=model)["losses"]
    fsdp = {"expert": 2, "data_parallel_sharding": "optim_grads_params"}
    first = run_segment(4, fsdp, 4, tmp_path / "a", "src", model=model)
    second = run_segment(2, {}, 6, tmp_path / "b", "mid", resume_from=tmp_path / "a" / "src", model=model)
    third = run_segment(4, fsdp, 8, tmp_path / "c", "dst", resume_from=tmp_path / "b" / "mid", model=model)
    assert (second["start"], third["start"]) == (4, 6)
    assert_continues(first["losses"] + second["losses"] + third["losses"], reference)
