"""Model features of the Hugging Face families (Qwen2/3, GPT-2, Llama 3.1, Mixtral, Qwen3-MoE), each
from the job spec: QKV bias, per-head q/k norms, a head size of its own (kv_channels), RoPE
scaling, the tanh GeLU and renormalised top-k gates.

Each feature is checked on one rank against a small plain-torch reference written here (or
transformers' own RoPE functions), and a model using the attention features together trains on
TP=2 (with and without sequence parallelism) exactly as on one rank.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.jobspec import JobSpecError, parse_job
from engine.parallel_placement import placement_of
from engine.transformer.activations import activation
from engine.transformer.attention import SelfAttention
from engine.transformer.config import TransformerConfig
from engine.transformer.mlp import MLP
from engine.transformer.moe.router import MoEConfig, TopKRouter
from engine.transformer.rope import RotaryEmbedding, inverse_frequencies
from tests.engine.parallel_harness import assert_same_training, job, max_rel_diff, run_job


def _config(**model) -> TransformerConfig:
    spec = {"name": "f", "model": {"num_layers": 1, "hidden_size": 24, "num_attention_heads": 4, **model}}
    return TransformerConfig.from_job(parse_job(spec), vocab_size=100)


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if "layernorm" in name else 0.0))


# --- attention: qkv_bias, qk_layernorm, kv_channels ---------------------------------------------


def _reference_attention(att: SelfAttention, x: torch.Tensor, c: TransformerConfig) -> torch.Tensor:
    """Qwen3's attention in plain torch: q/k/v from the per-group fused weight, RMSNorm per head,
    rotate-half RoPE, causal softmax(q k^T / sqrt(d)) v with k/v repeated per group, o_proj."""
    s, b, _ = x.shape
    a, g, d = c.num_attention_heads, c.num_query_groups, c.head_dim
    qkv = (x @ att.linear_qkv.weight.T + att.linear_qkv.bias).view(s, b, g, a // g + 2, d)
    q = qkv[..., : a // g, :].reshape(s, b, a, d)
    k, v = qkv[..., a // g, :], qkv[..., a // g + 1, :]

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_epsilon) * w

    q, k = rms(q, att.q_layernorm.weight), rms(k, att.k_layernorm.weight)
    inv_freq = 1.0 / c.rotary_base ** (torch.arange(0, d, 2).float() / d)
    angles = torch.cat([torch.outer(torch.arange(s).float(), inv_freq)] * 2, dim=-1)[:, None, None]

    def rope(t):
        return t * angles.cos() + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * angles.sin()

    q, k = rope(q).permute(1, 2, 0, 3), rope(k).permute(1, 2, 0, 3)  # [b, heads, s, d]
    k, v = k.repeat_interleave(a // g, 1), v.permute(1, 2, 0, 3).repeat_interleave(a // g, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, a * d)
    return out @ att.linear_proj.weight.T


def test_qkv_bias_qk_layernorm_and_kv_channels_match_a_reference():
    # hidden 24, 4 heads of 10 (40 != 24), 2 query groups: Qwen3's shape in miniature.
    c = _config(kv_channels=10, num_query_groups=2, qkv_bias=True, qk_layernorm=True)
    att = SelfAttention(c)
    assert att.linear_qkv.weight.shape == ((4 + 2 * 2) * 10, 24)
    assert att.linear_qkv.bias is not None and att.linear_proj.bias is None  # qkv only (Qwen2)
    assert att.q_layernorm.weight.shape == att.k_layernorm.weight.shape == (10,)
    assert placement_of(att.q_layernorm.weight).tp_partial_grad  # summed over TP even without SP
    _randomize(att)
    x = torch.randn(7, 2, 24, generator=torch.Generator().manual_seed(1))
    rotary = RotaryEmbedding(c.head_dim, c.rotary_base)(7, torch.float32)
    torch.testing.assert_close(att(x, rotary), _reference_attention(att, x, c), rtol=1e-5, atol=1e-5)


def test_qk_layernorm_parameter_names_and_gpt2_layernorm():
    names = {n for n, _ in SelfAttention(_config(qk_layernorm=True)).named_parameters()}
    assert {"q_layernorm.weight", "k_layernorm.weight"} <= names
    gpt2 = SelfAttention(_config(arch="gpt2", qk_layernorm=True))
    assert isinstance(gpt2.q_layernorm, torch.nn.LayerNorm) and placement_of(gpt2.q_layernorm.bias).tp_partial_grad


def test_qkv_bias_defaults_follow_the_arch():
    assert _config(arch="gpt2").qkv_bias and not _config(arch="llama").qkv_bias
    no_qkv_bias = SelfAttention(_config(arch="gpt2", qkv_bias=False))
    assert no_qkv_bias.linear_qkv.bias is None and no_qkv_bias.linear_proj.bias is not None


# --- RoPE scaling -------------------------------------------------------------------------------


def _transformers_inv_freq(rope_parameters: dict, head_dim: int) -> torch.Tensor:
    """Llama's rotary inverse frequencies as transformers builds them for this config."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )
    return LlamaRotaryEmbedding(hf).inv_freq


@pytest.mark.parametrize(
    "scaling",
    [
        {"type": "llama3", "factor": 8.0},  # Llama 3.1's values (low 1, high 4, original 8192)
        {
            "type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 4096,
        },
        {"type": "linear", "factor": 4.0},
    ],
    ids=["llama3.1", "llama3-custom", "linear"],
)
def test_rope_scaling_equals_transformers(scaling):
    c = _config(hidden_size=256, num_attention_heads=2, rotary_base=500000.0, rope_scaling=scaling)
    hf = {
        "rope_type": scaling["type"],
        "rope_theta": 500000.0,
        **{k: v for k, v in scaling.items() if k != "type"},
    }
    if scaling["type"] == "llama3":
        hf = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, **hf}
    expected = _transformers_inv_freq(hf, 128)
    assert torch.equal(RotaryEmbedding(c.head_dim, c.rotary_base, c.rope_scaling).inv_freq, expected)
    assert not torch.equal(expected, inverse_frequencies(128, 500000.0))  # the scaling did something


def test_unscaled_rope_equals_transformers_default():
    expected = _transformers_inv_freq({"rope_type": "default", "rope_theta": 10000.0}, 16)
    assert torch.equal(inverse_frequencies(16, 10000.0), expected)


# --- activation ---------------------------------------------------------------------------------


def test_gelu_tanh_is_gpt2_gelu_new_in_the_mlp():
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 4
    gelu_new = 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y.pow(3))))
    assert torch.equal(activation(y, "gelu_tanh"), F.gelu(y, approximate="tanh"))
    torch.testing.assert_close(activation(y, "gelu_tanh"), gelu_new, rtol=1e-6, atol=1e-6)
    assert not torch.equal(activation(y, "gelu_tanh"), activation(y, "gelu"))
    c = _config(arch="gpt2", activation="gelu_tanh")
    mlp = MLP(c)
    assert mlp.linear_fc1.weight.shape == (c.ffn_hidden_size, 24) == (96, 24)  # not gated: 4h wide
    _randomize(mlp)
    x = torch.randn(3, 2, 24)
    h = F.gelu(x @ mlp.linear_fc1.weight.T + mlp.linear_fc1.bias, approximate="tanh")
    torch.testing.assert_close(mlp(x), h @ mlp.linear_fc2.weight.T + mlp.linear_fc2.bias)


def test_moe_experts_use_the_model_activation():
    c = _config(arch="gpt2", activation="gelu_tanh", moe={"num_experts": 2, "top_k": 1})
    from engine.transformer.moe import MoELayer

    expert = MoELayer(c, c.moe).experts.local_experts[0]
    assert expert.activation == "gelu_tanh" and expert.linear_fc1.weight.shape == (96, 24)


# --- MoE: norm_topk_prob ------------------------------------------------------------------------


def test_norm_topk_prob_renormalises_gates_like_mixtral_and_keeps_the_aux_loss():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 8, generator=g), torch.randn(4, 8, generator=g)

    def route(norm):
        r = TopKRouter(
            8,
            MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=8, norm_topk_prob=norm),
            torch.float32,
            0.02,
            sequence_parallel=False,
        )
        with torch.no_grad():
            r.weight.copy_(w)
        return r(x)

    normed, plain, default = route(True), route(False), route(None)
    probs = torch.softmax(x @ w.T, dim=-1)  # Mixtral: softmax over all experts, top k, divide
    top, idx = probs.topk(2, dim=-1)
    assert torch.equal(normed.indices, idx)
    torch.testing.assert_close(normed.gates, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(normed.gates.sum(-1), torch.ones(9))
    torch.testing.assert_close(plain.gates, top)
    assert torch.equal(default.gates, plain.gates)  # softmax default: not renormalised
    assert torch.equal(normed.aux_loss, plain.aux_loss)  # computed on the unnormalised scores


# --- the job spec -------------------------------------------------------------------------------


def _refused(model: dict, pattern: str) -> None:
    with pytest.raises(JobSpecError, match=pattern):
        parse_job({"model": model})


def test_job_spec_refusals_name_the_field():
    _refused({"arch": "gpt2", "rope_scaling": {"type": "linear", "factor": 2.0}}, r"model\.rope_scaling")
    _refused(
        {"hidden_size": 64, "num_attention_heads": 4, "kv_channels": 15},
        r"model\.kv_channels .* even .*got 15",
    )
    _refused(
        {"rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 2.0}},
        r"model\.rope_scaling\.low_freq_factor applies to type llama3 only",
    )
    _refused(
        {"rope_scaling": {"type": "llama3", "factor": 8.0, "high_freq_factor": 1.0}},
        r"model\.rope_scaling\.high_freq_factor",
    )
    _refused({"rope_scaling": {"type": "llama3", "factor": 0.0}}, r"model\.rope_scaling\.factor")
    _refused({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"model\.rope_scaling\.type")
    _refused({"activation": "relu"}, r"model\.activation")
    _refused({"moe": {"num_experts": 4, "norm_topk_prob": "maybe"}}, r"model\.moe\.norm_topk_prob")


def test_job_spec_defaults_and_kv_channels():
    llama, gpt2 = parse_job({}).model, parse_job({"model": {"arch": "gpt2"}}).model
    assert (llama.activation, llama.qkv_bias, llama.qk_layernorm) == ("swiglu", False, False)
    assert (gpt2.activation, gpt2.qkv_bias, gpt2.rope_scaling) == ("gelu", True, None)
    assert llama.kv_channels is None and llama.head_dim == 64 // 4
    # kv_channels frees hidden_size from divisibility by the heads (Qwen3: 1024 hidden, 16 x 128).
    qwen3 = parse_job({"model": {"hidden_size": 1024, "num_attention_heads": 16, "kv_channels": 128}}).model
    assert qwen3.head_dim == 128
    # gelu on llama: the default ffn is 4h (the 8/3 rule is SwiGLU's).
    assert parse_job({"model": {"activation": "gelu"}}).model.ffn_hidden_size == 4 * 64


# --- TP (and SP) equal one rank -----------------------------------------------------------------

# 4 heads of 24 (96 != hidden 64), 2 query groups, QKV bias and RMSNorm'd q/k: Qwen2 + Qwen3.
QWEN = {"kv_channels": 24, "qkv_bias": True, "qk_layernorm": True}
ITERS = {"train_iters": 3}


@pytest.fixture(scope="module")
def qwen_reference():
    return run_job(job(1, model=QWEN, training=ITERS))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_qwen_features_tp2_match_single_rank(qwen_reference, sequence_parallel):
    got = run_job(
        job(2, model=QWEN, training=ITERS, parallel={"tensor": 2, "sequence_parallel": sequence_parallel})
    )
    assert_same_training(got, qwen_reference)
    for a, b in zip(got["losses"], qwen_reference["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    diff, where = max_rel_diff(got["grads"], qwen_reference["grads"])
    assert diff < 1e-5, f"gradient of {where} differs by {diff:.2e}"
    q_norm = "decoder.layers.0.self_attention.q_layernorm.weight"
    assert q_norm in got["grads"] and got["grads"][q_norm].abs().max() > 0
    assert got["grads"]["decoder.layers.0.self_attention.linear_qkv.bias"].abs().max() > 0


def test_qwen_features_tp2_cp2_match_single_rank(qwen_reference):
    """The per-head norms run before the context-parallel ring attention, on this rank's chunks."""
    got = run_job(job(4, model=QWEN, training=ITERS, parallel={"tensor": 2, "context": 2}))
    assert_same_training(got, qwen_reference)


def test_gpt2_qk_layernorm_and_gelu_tanh_tp2_sp_match_single_rank():
    """GPT-2 style q/k norms are LayerNorms: their bias, too, is summed over TP. The k norm's bias
    shifts every key by one vector, which softmax ignores: its gradient is zero up to round-off
    (~1e-10, different per reduction order), so it is checked against zero, not relatively."""
    model = {"arch": "gpt2", "num_query_groups": None, "kv_channels": 24, "qk_layernorm": True}
    model["activation"] = "gelu_tanh"
    ref = run_job(job(1, model=model, training=ITERS))
    got = run_job(job(2, model=model, training=ITERS, parallel={"tensor": 2, "sequence_parallel": True}))
    for layer in range(2):
        k_bias = f"decoder.layers.{layer}.self_attention.k_layernorm.bias"
        for run in (got, ref):
            assert (
                run["grads"].pop(k_bias).abs().max() < 1e-8 and run["params"].pop(k_bias).abs().max() < 1e-5
            )
    assert_same_training(got, ref)
    assert got["grads"]["decoder.layers.0.self_attention.q_layernorm.bias"].abs().max() > 0
