"""Every TP x PP x DP layout trains the same model to the same losses as one rank.

A 4-layer model, global batch 8, 5 AdamW steps, the same data and seed on every layout.
Tolerances (fp32): per-iteration loss and global grad norm within 1e-5 relative; last-step
gradients (where they are whole on each rank) and the parameters after 5 steps within 1e-4 of
each tensor's largest magnitude. A layout changes only how the same sums are split and ordered.
"""

from __future__ import annotations

import pytest

from tests.engine.parallel_harness import assert_same_training, job, run_job

LLAMA = {"num_layers": 4}
GPT2 = {"arch": "gpt2", "num_layers": 4, "num_query_groups": None}
TRAINING = {"global_batch_size": 8, "micro_batch_size": 1}


@pytest.fixture(scope="module")
def llama_reference():
    return run_job(job(1, model=LLAMA, training=TRAINING))


@pytest.fixture(scope="module")
def gpt2_reference():
    return run_job(job(1, model=GPT2, training=TRAINING))


LAYOUTS = {
    "dp4": {"parallel": {}},
    "dp2-distributed-optimizer": {"parallel": {"distributed_optimizer": True}, "ranks": 2},
    "dp4-distributed-optimizer-small-buckets": {
        "parallel": {"distributed_optimizer": True, "grad_bucket_size": 5000}
    },
    "tp2-dp2": {"parallel": {"tensor": 2}},
    "pp2-dp2-1f1b": {"parallel": {"pipeline": 2}},
    "pp2-vp2-interleaved": {"parallel": {"pipeline": 2, "virtual_pipeline": 2}, "ranks": 2},
    "pp2-uneven-1-3": {"parallel": {"pipeline": 2, "pipeline_layers": [1, 3]}, "ranks": 2},
    "tp2-pp2": {"parallel": {"tensor": 2, "pipeline": 2}},
    "tp2-pp2-sp-full-recompute": {
        "parallel": {"tensor": 2, "pipeline": 2, "sequence_parallel": True},
        "training": {"recompute": "full"},
    },
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_layout_matches_single_rank(llama_reference, layout):
    case = LAYOUTS[layout]
    training = {**TRAINING, **case.get("training", {})}
    got = run_job(job(case.get("ranks", 4), model=LLAMA, training=training, parallel=case["parallel"]))
    assert_same_training(got, llama_reference)


@pytest.mark.parametrize(
    "parallel",
    [{"pipeline": 2}, {"pipeline": 2, "tensor": 2, "sequence_parallel": True, "distributed_optimizer": True}],
    ids=["pp2-dp2", "tp2-pp2-sp-distributed-optimizer"],
)
def test_gpt2_tied_embeddings_across_pipeline_stages(gpt2_reference, parallel):
    """The last stage's copy of the tied embedding gets the summed gradient and stays equal."""
    got = run_job(job(4, model=GPT2, training=TRAINING, parallel=parallel))
    assert_same_training(got, gpt2_reference)
    assert got["tied_copy_diff"] is not None and got["tied_copy_diff"] < 1e-6, got["tied_copy_diff"]


def test_bf16_tracks_fp32(llama_reference):
    """bf16 params with fp32 master weights and fp32 grad reduction, on TP2 x DP2: per-iteration
    loss within 2% of the fp32 single-rank run (bf16 keeps 8 bits of mantissa)."""
    got = run_job(job(4, model=LLAMA, training={**TRAINING, "precision": "bf16"}, parallel={"tensor": 2}))
    for it, (a, b) in enumerate(zip(got["losses"], llama_reference["losses"], strict=True)):
        assert a == pytest.approx(b, rel=2e-2), f"iteration {it + 1}: bf16 {a} vs fp32 {b}"
    assert got["losses"][-1] < got["losses"][0]


def test_fp16_with_loss_scaling_trains_on_dp2(llama_reference):
    """fp16 params, dynamic loss scaling from 2^16 on DP=2: no step skipped at this scale, loss
    within 2% of fp32 (the scaler's skip/recover path is tested in test_optimizer.py)."""
    got = run_job(job(2, model=LLAMA, training={**TRAINING, "precision": "fp16"}))
    assert not any(got["skipped"]), got["skipped"]
    assert got["loss_scales"][0] == 2.0**16
    for it, (a, b) in enumerate(zip(got["losses"], llama_reference["losses"], strict=True)):
        assert a == pytest.approx(b, rel=2e-2), f"iteration {it + 1}: fp16 {a} vs fp32 {b}"


def test_batch_size_rampup_changes_microbatches_mid_run_on_pp2_dp2():
    """Global batch 4, 4, then 8 (Megatron's rampup [start 4, +4, over 8 samples]): the pipeline
    schedule and the DP buffers' backward count follow the number of microbatches (2 -> 4)."""
    training = {**TRAINING, "rampup_batch_size": [4, 4, 8]}
    ref = run_job(job(1, model=LLAMA, training=training))
    got = run_job(job(4, model=LLAMA, training=training, parallel={"pipeline": 2}))
    assert got["global_batch_sizes"] == [4, 4, 8, 8, 8]
    assert_same_training(got, ref)
