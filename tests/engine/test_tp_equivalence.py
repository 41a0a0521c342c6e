"""Tensor (and sequence) parallel training equals single-rank training on the same data and seed.

Tolerances (fp32): per-iteration loss and global grad norm within 1e-5 relative; last-iteration gradients and the
parameters after 5 AdamW steps within 1e-4 of each tensor's largest magnitude. The only
differences allowed are reduction order in the TP all-reduces / reduce-scatters.
"""

from __future__ import annotations

import pytest

from tests.engine.parallel_harness import job, max_rel_diff, run_job

LOSS_RTOL = 1e-5
TENSOR_RTOL = 1e-4


@pytest.fixture(scope="module")
def llama_reference():
    return run_job(job(1))


@pytest.fixture(scope="module")
def gpt2_reference():
    return run_job(job(1, model={"arch": "gpt2", "num_query_groups": None}))


def _assert_same_training(got: dict, ref: dict) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == 5
    for it, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert a == pytest.approx(b, rel=LOSS_RTOL), f"iteration {it + 1}: loss {a} vs reference {b}"
    # The global grad norm counts each parameter once: sharded ones on every TP rank, replicated
    # ones (norms, row-parallel biases) once, whatever the layout.
    for it, (a, b) in enumerate(zip(got["grad_norms"], ref["grad_norms"], strict=True)):
        assert a == pytest.approx(b, rel=LOSS_RTOL), f"iteration {it + 1}: grad norm {a} vs reference {b}"
    diff, where = max_rel_diff(got["grads"], ref["grads"])
    assert diff < TENSOR_RTOL, f"gradient of {where} differs by {diff:.2e} (relative)"
    diff, where = max_rel_diff(got["params"], ref["params"])
    assert diff < TENSOR_RTOL, f"parameter {where} differs by {diff:.2e} (relative) after 5 steps"


def test_reference_learns(llama_reference):
    losses = llama_reference["losses"]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_llama_tp2_matches_single_rank(llama_reference, sequence_parallel):
    got = run_job(job(2, parallel={"tensor": 2, "sequence_parallel": sequence_parallel}))
    _assert_same_training(got, llama_reference)


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
    _assert_same_training(got, gpt2_reference)


def test_data_parallel_2_matches_single_rank(llama_reference):
    got = run_job(job(2))
    _assert_same_training(got, llama_reference)


def test_a_real_difference_is_detected(llama_reference):
    """The comparison can fail: a different seed gives a different model and different losses."""
    got = run_job(job(1, training={"seed": 8}))
    with pytest.raises(AssertionError):
        _assert_same_training(got, llama_reference)
