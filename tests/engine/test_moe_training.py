"""MoE models train to the single-rank run's losses, gradients and weights on expert-parallel
layouts (EP=2; EP=2 with TP=2 and sequence parallelism, attention and experts folded differently
over the same 4 ranks), and expert checkpoints reshard across EP sizes."""

from __future__ import annotations

import pytest

from engine.launcher import spawn
from tests.engine.parallel_harness import assert_continues, assert_same_training, job, run_job, train_until

MOE = {"num_experts": 4, "top_k": 2, "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}


def moe_job(ranks: int, **parallel) -> dict:
    return job(ranks, model={"moe": MOE}, parallel=parallel)


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_job(moe_job(1))


def test_single_rank_moe_trains(reference):
    assert reference["losses"][-1] < reference["losses"][0]
    experts = [k for k in reference["params"] if ".experts.local_experts." in k]
    assert len(experts) == 2 * 4 * 2  # layers x experts x (fc1, fc2)


@pytest.mark.parametrize(
    ("ranks", "parallel"),
    [
        (2, {"expert": 2}),
        (4, {"expert": 2, "tensor": 2, "sequence_parallel": True}),
    ],
    ids=["ep2-dp2", "ep2-tp2-sp"],
)
def test_expert_parallel_matches_single_rank(reference, ranks, parallel):
    assert_same_training(run_job(moe_job(ranks, **parallel)), reference)


def test_moe_checkpoint_from_ep2_resumes_on_ep1_and_continues(tmp_path):
    """Iterations 1-3 on EP=2 (experts split over 2 ranks), 4-5 on one rank holding all experts
    (with aux-loss-free expert bias, whose state is in the checkpoint too): the losses are the
    uninterrupted single-rank run's."""
    moe = {**MOE, "expert_bias": True, "expert_bias_update_rate": 0.01}

    def spec(ranks: int, name: str, **parallel) -> dict:
        return job(
            ranks, name=name, model={"moe": moe}, parallel=parallel, checkpoint={"path": str(tmp_path)}
        )

    reference = spawn(train_until, 1, (spec(1, "ref"), 5))[0]["losses"]
    first = spawn(train_until, 2, (spec(2, "moe", expert=2), 3))[0]
    second = spawn(train_until, 1, (spec(1, "moe"), 5))[0]
    assert first["start"] == 0 and second["start"] == 3
    assert_continues(first["losses"] + second["losses"], reference)


DEEPSEEK_ROUTING = {
    "num_experts": 8, "top_k": 2, "router_score": "sigmoid", "num_groups": 4, "topk_group": 2,
    "routed_scaling_factor": 2.5, "load_balancing_type": "seq_aux_loss", "aux_loss_coeff": 0.01,
    "expert_bias": True, "expert_bias_update_rate": 0.01, "shared_expert_ffn_hidden_size": 64,
    "layer_pattern": [0, 1],  # a dense first layer, as DeepSeek-V3's first three
}


def test_deepseek_v3_routing_on_ep2_tp2_sp_matches_single_rank():
    """Group-limited routing, scaled gates, the sequence-wise aux loss (its counts summed over
    the TP ranks' sequence chunks), expert bias, a shared expert and a dense first layer."""
    spec = {"model": {"moe": DEEPSEEK_ROUTING}}
    reference = run_job(job(1, **spec))
    got = run_job(job(4, **spec, parallel={"expert": 2, "tensor": 2, "sequence_parallel": True}))
    assert_same_training(got, reference)
