"""A DeepSeek-V3-style model (MLA, MTP, dense-first MoE with group routing, expert bias, shared
expert, sequence-wise aux loss) checkpoints on one layout and continues on another exactly as
the uninterrupted single-rank run; the shipped example validates."""

from __future__ import annotations

from pathlib import Path

from engine.jobspec import load_job
from engine.launcher import spawn
from tests.engine.parallel_harness import assert_continues, job, train_until

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepseek_tiny.yaml"
MODEL = {
    "attention": "mla",
    "mla": {
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 12,
    },
    "mtp_num_layers": 1,
    "moe": {
        "num_experts": 4,
        "top_k": 2,
        "router_score": "sigmoid",
        "num_groups": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "expert_bias": True,
        "expert_bias_update_rate": 0.01,
        "shared_expert_ffn_hidden_size": 32,
        "layer_pattern": [0, 1],
        "load_balancing_type": "seq_aux_loss",
    },
}


def test_saved_on_tp2_ep2_resumes_on_pp2_and_continues(tmp_path):
    """TP=2+SP x EP=2, then PP=2, then EP=2 with fully sharded data parallelism (the MTP depth's
    experts live in the root unit, sharded over the expert data-parallel group)."""

    def spec(ranks: int, name: str, **parallel) -> dict:
        return job(ranks, name=name, model=MODEL, parallel=parallel, checkpoint={"path": str(tmp_path)})

    reference = spawn(train_until, 1, (spec(1, "ref"), 7), timeout_s=240)[0]["losses"]
    first = spawn(
        train_until, 4, (spec(4, "ds", tensor=2, sequence_parallel=True, expert=2), 3), timeout_s=240
    )[0]
    second = spawn(train_until, 2, (spec(2, "ds", pipeline=2), 5), timeout_s=240)[0]
    fsdp = spec(4, "ds", expert=2, data_parallel_sharding="optim_grads_params")
    fsdp["training"]["micro_batch_size"] = 1  # DP=4 of the same global batch
    third = spawn(train_until, 4, (fsdp, 7), timeout_s=240)[0]
    assert (first["start"], second["start"], third["start"]) == (0, 3, 5)
    assert_continues(first["losses"] + second["losses"] + third["losses"], reference)


def test_example_validates():
    spec = load_job(EXAMPLE)
    assert spec.model.attention == "mla" and spec.model.mtp_num_layers == 1
    assert spec.model.moe.layer_pattern == [0, 1, 1, 1] and spec.data_parallel_size == 2
