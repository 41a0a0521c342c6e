"""Multi-latent attention (model.attention: mla): equal to transformers' DeepSeek-V3 attention on
one rank (tests/engine/test_hf_families.py), and every layout equal to one rank (losses,
gradients, weights: the harness's tolerances): TP with and without sequence parallelism, PP, CP."""

from __future__ import annotations

import pytest

from tests.engine.parallel_harness import assert_same_training, job, run_job

MLA = {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12}


def mla_job(ranks: int, mla: dict = MLA, **parallel) -> dict:
    return job(ranks, model={"attention": "mla", "mla": mla}, parallel=parallel)


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_job(mla_job(1))


def test_mla_trains_on_one_rank(reference):
    assert reference["losses"][-1] < reference["losses"][0]
    assert "decoder.layers.0.self_attention.linear_kv_down_proj.weight" in reference["params"]


@pytest.mark.parametrize(
    ("ranks", "parallel"),
    [
        (2, {"tensor": 2}),
        (2, {"tensor": 2, "sequence_parallel": True}),
        (2, {"pipeline": 2}),
        (2, {"context": 2}),
        (4, {"context": 2, "tensor": 2, "sequence_parallel": True}),
    ],
    ids=["tp2", "tp2-sp", "pp2", "cp2", "cp2-tp2-sp"],
)
def test_mla_layouts_match_single_rank(reference, ranks, parallel):
    assert_same_training(run_job(mla_job(ranks, **parallel)), reference)


def test_mla_with_values_wider_than_keys_on_cp2():
    mla = {**MLA, "v_head_dim": 20}  # the ring's K/V pair is padded on the query side
    assert_same_training(run_job(mla_job(2, mla, context=2)), run_job(mla_job(1, mla)))


def test_mla_without_query_latent_on_tp2_sp():
    mla = {**MLA, "q_lora_rank": None}
    assert_same_training(run_job(mla_job(2, mla, tensor=2, sequence_parallel=True)), run_job(mla_job(1, mla)))
