"""MoE pieces: the router's losses against a hand computation, capacity dropping, and the
all-to-all dispatch over 2 expert-parallel ranks against every expert on one rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.launcher import spawn
from engine.transformer.moe.experts import LocalExperts
from engine.transformer.moe.router import MoEConfig, TopKRouter
from engine.transformer.moe.token_dispatcher import AllToAllDispatcher


def router(moe: MoEConfig, hidden: int = 4, seed: int = 0) -> TopKRouter:
    r = TopKRouter(hidden, moe, torch.float32, 0.02, sequence_parallel=False)
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return r


def test_aux_and_z_loss_match_a_hand_computation():
    moe = MoEConfig(num_experts=3, top_k=2, ffn_hidden_size=8, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    r = router(moe)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    out = r(x)

    logits = [
        [sum(x[t, i].item() * r.weight[e, i].item() for i in range(4)) for e in range(3)] for t in range(5)
    ]
    scores = [[math.exp(v) / sum(math.exp(w) for w in row) for v in row] for row in logits]
    chosen = [sorted(range(3), key=lambda e, row=row: -row[e])[:2] for row in scores]
    n = [sum(e in c for c in chosen) for e in range(3)]
    p = [sum(scores[t][e] for t in range(5)) for e in range(3)]
    aux = 0.1 * 3 / (5 * 5 * 2) * sum(p[e] * n[e] for e in range(3))
    z = 0.01 * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 5

    assert out.aux_loss.item() == pytest.approx(aux + z, rel=1e-5)
    assert [sorted(c) for c in out.indices.tolist()] == [sorted(c) for c in chosen]
    expected_gates = [scores[t][e] for t in range(5) for e in chosen[t]]
    assert out.gates.reshape(-1).tolist() == pytest.approx(expected_gates, rel=1e-5)
    assert out.tokens_per_expert.tolist() == n


def test_sigmoid_gates_sum_to_one_and_expert_bias_changes_the_pick_not_the_gate():
    moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=8, score="sigmoid", expert_bias=True)
    r = router(moe)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    first = r(x)
    assert first.gates.sum(-1).tolist() == pytest.approx([1.0] * 6)
    with torch.no_grad():
        r.expert_bias[:] = torch.tensor([100.0, 100.0, 0.0, 0.0])  # force experts 0 and 1
    forced = r(x)
    assert sorted(map(sorted, forced.indices.tolist())) == [[0, 1]] * 6
    sig = torch.sigmoid(x @ r.weight.t())[:, :2]
    expected = sig / sig.sum(-1, keepdim=True)  # gate of expert 0, of expert 1
    got = torch.zeros(6, 2).scatter(1, forced.indices, forced.gates)
    assert got.reshape(-1).tolist() == pytest.approx(expected.reshape(-1).tolist(), rel=1e-5)


def test_expert_bias_update_moves_toward_the_underused_expert():
    moe = MoEConfig(num_experts=3, top_k=1, ffn_hidden_size=8, expert_bias=True, expert_bias_update_rate=0.5)
    r = router(moe)
    r.step_tokens_per_expert.copy_(torch.tensor([6.0, 3.0, 0.0]))
    r.update_expert_bias(None)
    assert r.expert_bias.tolist() == [-0.5, 0.0, 0.5] and r.step_tokens_per_expert.sum() == 0


def test_capacity_drops_the_lowest_gated_assignments_beyond_capacity():
    moe = MoEConfig(num_experts=2, top_k=1, ffn_hidden_size=8, capacity_factor=1.0)
    r = router(moe, hidden=2)
    with torch.no_grad():
        r.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    # Six tokens all preferring expert 0, by margins 1..6: capacity = ceil(6 * 1 / 2 * 1.0) = 3.
    x = torch.tensor([[float(m), 0.0] for m in range(1, 7)])
    out = r(x)
    assert out.indices.reshape(-1).tolist() == [0] * 6
    assert out.dropped == 3
    assert out.kept.reshape(-1).tolist() == [False, False, False, True, True, True]


def _experts_state(global_experts: range, hidden: int, ffn: int) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for e in global_experts:
        g = torch.Generator().manual_seed(100 + e)
        out[e] = {
            "fc1": torch.randn(2 * ffn, hidden, generator=g) * 0.3,
            "fc2": torch.randn(hidden, ffn, generator=g) * 0.3,
        }
    return out


def _load(experts: LocalExperts, weights: dict[int, dict[str, torch.Tensor]], offset: int) -> None:
    with torch.no_grad():
        for j, mlp in enumerate(experts.local_experts):
            mlp.linear_fc1.weight.copy_(weights[offset + j]["fc1"])
            mlp.linear_fc2.weight.copy_(weights[offset + j]["fc2"])


def _dispatch_rank(num_experts: int, top_k: int) -> dict:
    """Same tokens through (a) experts spread over 2 EP ranks and (b) all experts here."""
    ps.initialize_model_parallel(expert=2, expert_tensor=1)
    rank, hidden, ffn = dist.get_rank(), 6, 5
    tokens = torch.randn(7 + rank, hidden, generator=torch.Generator().manual_seed(rank))
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, ffn_hidden_size=ffn)
    r = router(moe, hidden)
    weights = _experts_state(range(num_experts), hidden, ffn)
    results = {}
    for mode, group in (("ep", ps.get_group("ep")), ("local", None)):
        x = tokens.clone().requires_grad_(True)
        dispatcher = AllToAllDispatcher(num_experts, group)
        local = num_experts // dispatcher.ep
        experts = LocalExperts(
            local,
            hidden=hidden,
            ffn=ffn,
            activation="swiglu",
            dtype=torch.float32,
            init_std=0.02,
            out_std=0.02,
        )
        offset = rank * local if group is not None else 0
        _load(experts, weights, offset)
        routing = r(x)
        rows, per_expert = dispatcher.dispatch(x, routing.indices, routing.kept)
        out = dispatcher.combine(experts(rows, per_expert), routing.gates, routing.kept, x.shape[0])
        (out * torch.arange(out.numel()).view_as(out).float().cos()).sum().backward()
        grads = {offset + j: m.linear_fc1.weight.grad.clone() for j, m in enumerate(experts.local_experts)}
        results[mode] = {"out": out.detach(), "dx": x.grad.clone(), "grads": grads}
        r.zero_grad()
    # An expert's gradient on its EP rank sums the tokens of every rank; locally, each rank only
    # sees its own: sum the local ones over both ranks to compare.
    for g in results["local"]["grads"].values():
        dist.all_reduce(g)
    ps.destroy_model_parallel()
    return {
        "out": torch.allclose(results["ep"]["out"], results["local"]["out"], atol=1e-6),
        "dx": torch.allclose(results["ep"]["dx"], results["local"]["dx"], atol=1e-6),
        "grads": all(
            torch.allclose(g, results["local"]["grads"][e], atol=1e-5)
            for e, g in results["ep"]["grads"].items()
        ),
        "experts_here": sorted(results["ep"]["grads"]),
    }


@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 2), (2, 1)])
def test_all_to_all_dispatch_over_two_ranks_equals_all_experts_on_one(num_experts, top_k):
    results = spawn(_dispatch_rank, 2, (num_experts, top_k))
    for rank, res in enumerate(results):
        assert res["out"] and res["dx"] and res["grads"], (rank, res)
        half = num_experts // 2
        assert res["experts_here"] == list(range(rank * half, (rank + 1) * half))


def test_group_limited_routing_matches_deepseek_v3():
    """Group-limited top-k with the aux-loss-free bias, normalised and scaled gates: the experts
    and weights transformers' DeepseekV3TopkRouter picks for the same weight, bias and tokens."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    theirs = DeepseekV3TopkRouter(cfg)
    moe = MoEConfig(
        num_experts=8,
        top_k=3,
        ffn_hidden_size=8,
        score="sigmoid",
        expert_bias=True,
        norm_topk_prob=True,
        num_groups=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        aux_loss_coeff=0.0,
    )
    ours = router(moe, hidden=16, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        bias = torch.randn(8, generator=g) * 0.1
        theirs.e_score_correction_bias.copy_(bias)
        ours.expert_bias.copy_(bias)
    x = torch.randn(64, 16, generator=g)
    _, weights, indices = theirs(x)
    got = ours(x)
    order_theirs, order_ours = indices.sort(dim=-1), got.indices.sort(dim=-1)
    assert torch.equal(order_theirs.values, order_ours.values)
    assert torch.allclose(
        weights.gather(1, order_theirs.indices), got.gates.gather(1, order_ours.indices), rtol=1e-6
    )
    # the group limit matters here: without it some tokens pick other experts
    free = router(MoEConfig(**{**moe.__dict__, "num_groups": None, "topk_group": None}), hidden=16, seed=3)
    with torch.no_grad():
        free.expert_bias.copy_(bias)
    assert not torch.equal(free(x).indices.sort(dim=-1).values, order_ours.values)


def test_sequence_aux_loss_matches_a_hand_computation():
    moe = MoEConfig(
        num_experts=4, top_k=2, ffn_hidden_size=8, score="sigmoid", aux_loss_coeff=0.1, seq_aux_loss=True
    )
    r = router(moe)
    s, b = 5, 3
    x = torch.randn(s * b, 4, generator=torch.Generator().manual_seed(2))  # position-major [s, b]
    out = r(x, sequences=b)
    scores = torch.sigmoid(x @ r.weight.detach().t())
    probs = scores / scores.sum(-1, keepdim=True)
    chosen = scores.topk(2, dim=-1).indices
    want = 0.0
    for j in range(b):
        rows = [t * b + j for t in range(s)]
        f = [4 / (2 * s) * sum(int(e in chosen[t]) for t in rows) for e in range(4)]
        p = [sum(float(probs[t, e]) for t in rows) / s for e in range(4)]
        want += 0.1 * sum(f[e] * p[e] for e in range(4)) / b
    assert out.aux_loss.detach().item() == pytest.approx(want, rel=1e-6)
