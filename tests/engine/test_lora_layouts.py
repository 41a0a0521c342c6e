"""LoRA trains the same adapters on every layout as on one rank: TP=2 with sequence
parallelism (column adapters' A summed over TP, row adapters' B partial under SP), PP=2 (and
virtual stages), DP=2 at every sharding level (only adapters in the buckets), and CP=2; GPT-2
style too (biases, a non-gated MLP, the embedding tied across pipeline stages and frozen).
Adapters on every projection (fused QKV with GQA, SwiGLU's gate|up), a random frozen base
(layout-independent init), 4 steps: losses and grad norms within 1e-5, the adapters' last
gradients and final values within 1e-4 of each tensor's largest
(tests/engine/parallel_harness.py's tolerances)."""

from __future__ import annotations

import pytest

from tests.engine.parallel_harness import assert_same_training, job, run_job

LORA = {"lora": {"rank": 4, "alpha": 8, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}}
TRAINING = {"train_iters": 4}
OPTIMIZER = {"lr": 1e-2}
GPT2 = {"arch": "gpt2", "num_query_groups": None, **LORA}


def lora_job(ranks: int, model: dict | None = None, **parallel) -> dict:
    model = {"num_layers": 4, **(model or LORA)}
    return job(ranks, model=model, training=TRAINING, optimizer=OPTIMIZER, parallel=parallel)


@pytest.fixture(scope="module")
def reference():
    ref = run_job(lora_job(1))
    # Only adapters are compared (and trained): 4 layers x 2 (A and B) x (q, k, v, o, gate, up, down).
    assert ref["params"] and all(".lora." in k for k in ref["params"])
    assert len(ref["params"]) == 4 * 2 * (3 + 1 + 2 + 1)
    assert ref["losses"][-1] < ref["losses"][0]
    return ref


@pytest.fixture(scope="module")
def gpt2_reference():
    ref = run_job(lora_job(1, GPT2))
    assert len(ref["params"]) == 4 * 2 * (3 + 1 + 1 + 1)  # fc1 is up_proj alone
    return ref


@pytest.mark.parametrize(
    "parallel",
    [
        {"tensor": 2, "sequence_parallel": True},
        {"pipeline": 2},
        {"pipeline": 2, "virtual_pipeline": 2},
        {},
        {"data_parallel_sharding": "optim"},
        {"data_parallel_sharding": "optim_grads"},
        {"data_parallel_sharding": "optim_grads_params"},
        {"context": 2},
    ],
    ids=["tp2-sp", "pp2", "pp2-vp2", "dp2", "dp2-optim", "dp2-optim-grads", "dp2-optim-grads-params", "cp2"],
)
def test_layout_matches_one_rank(reference, parallel):
    assert_same_training(run_job(lora_job(2, **parallel)), reference)


@pytest.mark.parametrize(
    "parallel", [{"tensor": 2, "sequence_parallel": True}, {"pipeline": 2}], ids=["tp2-sp", "pp2-tied-embedding"]
)
def test_gpt2_layout_matches_one_rank(gpt2_reference, parallel):
    assert_same_training(run_job(lora_job(2, GPT2, **parallel)), gpt2_reference)


def test_hybrid_sharded_dp4_matches_one_rank(reference):
    """HSDP: parameters sharded over pairs of ranks, the pairs' gradients all-reduced."""
    spec = lora_job(4, data_parallel_sharding="optim_grads_params", data_parallel_shard_size=2)
    spec["training"]["micro_batch_size"] = 1  # 4 samples over 4 DP ranks
    assert_same_training(run_job(spec), reference)
