"""Tensor (and sequence) parallel training equals single-rank training on the same data and seed.

Tolerances (fp32): per-iteration loss and global grad norm within 1e-5 relative; last-iteration gradients and the
parameters after 5 AdamW steps within 1e-4 of each tensor's largest magnitude. The only
differences allowed are reduction order in the TP all-reduces / reduce-scatters.
"""

from __future__ import annotations

import pytest

from tests.engine.parallel_harness import assert_same_training, job, run_job


@pytest.fixture(scope="module")
def llama_reference():
    return run_job(job(1))


@pytest.fixture(scope="module")
def gpt2_reference():
    return run_job(job(1, model={"arch": "gpt2", "num_query_groups": None}))


def test_reference_learns(llama_reference):
    losses = llama_reference["losses"]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_llama_tp2_matches_single_rank(llama_reference, sequence_parallel):
    got = run_job(job(2, parallel={"tensor": 2, "sequence_parallel": sequence_parallel}))
    assert_same_training(got, llama_reference)


def test_gpt2_tp2_sp_matches_single_rank(gpt2_reference):
    """GPT-2 style adds what Llama lacks: biases (row-parallel bias under SP), LayerNorm, learned
    positions (chunked under SP) and tied embeddings (output layer uses the embedding shard)."""
    got = run_job(
        job(
            2,
            model={"arch": "gpt2", "num_query_groups": None},
            parallel={"tensor": 2, "sequence_parallel": True},
        )
    )
    assert_same_training(got, gpt2_reference)


def test_data_parallel_2_matches_single_rank(llama_reference):
    got = run_job(job(2))
    assert_same_training(got, llama_reference)


def test_a_real_difference_is_detected(llama_reference):
    """The comparison can fail: a different seed gives a different model and different losses."""
    got = run_job(job(1, training={"seed": 8}))
    with pytest.raises(AssertionError):
        assert_same_training(got, llama_reference)
