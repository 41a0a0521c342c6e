import json

import pytest
import torch

from engine import flops
from engine.flops import PeakFlops, mfu, model_flops_per_iteration, peak_flops
from engine.transformer.config import TransformerConfig


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        padded_vocab_size=128,
        seq_length=32,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding="rope",
        add_bias_linear=False,
        tie_embeddings=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def test_hand_count_small_llama():
    # B=3 sequences of s=32 tokens; h=64, 4 heads of d=16, 2 KV heads, f=96, V=128, L=2.
    B, s, h, heads, d, kv, f, V, L = 3, 32, 64, 4, 16, 2, 96, 128, 2
    # Forward FLOPs of one sequence, each GEMM (m x k) @ (k x n) costing 2mkn.
    q = 2 * s * h * (heads * d)  # 262144
    k = 2 * s * h * (kv * d)  # 131072
    v = 2 * s * h * (kv * d)  # 131072
    # Scores QK^T: per head (s x d) @ (d x s); causal, so half of it (Megatron-Core's count).
    scores = heads * 2 * s * d * s / 2  # 65536
    # Probabilities x V: per head (s x s) @ (s x d), again half.
    attn_v = heads * 2 * s * s * d / 2  # 65536
    out_proj = 2 * s * (heads * d) * h  # 262144
    gate = 2 * s * h * f  # 393216
    up = 2 * s * h * f  # 393216
    down = 2 * s * f * h  # 393216
    layer = q + k + v + scores + attn_v + out_proj + gate + up + down  # 2097152
    logits = 2 * s * h * V  # 524288
    forward = L * layer + logits  # 4718592
    expected = 3 * B * forward  # forward + backward (2x forward)
    assert expected == 42_467_328
    assert model_flops_per_iteration(_config(), global_batch_size=B) == expected


def test_full_attention_matrix_counts_the_masked_half_too():
    B, s, heads, d, L = 3, 32, 4, 16, 2
    causal = model_flops_per_iteration(_config(), B)
    full = model_flops_per_iteration(_config(), B, full_attention_matrix=True)
    masked_half = 2 * heads * 2 * s * s * d / 2  # scores and attn x V
    assert full - causal == 3 * B * L * masked_half


def test_gqa_counts_smaller_key_value_projections():
    B, s, h, d, L = 3, 32, 64, 16, 2
    mha = model_flops_per_iteration(_config(num_query_groups=4), B)
    gqa = model_flops_per_iteration(_config(num_query_groups=2), B)
    mqa = model_flops_per_iteration(_config(num_query_groups=1), B)
    # K and V each lose 2 * s * h * d per KV head dropped.
    assert mha - gqa == 3 * B * L * 2 * (2 * s * h * d) * (4 - 2)
    assert gqa - mqa == 3 * B * L * 2 * (2 * s * h * d) * (2 - 1)


def test_swiglu_has_one_more_matrix_than_gelu():
    B, s, h, f, L = 3, 32, 64, 96, 2
    swiglu = model_flops_per_iteration(_config(activation="swiglu"), B)
    gelu = model_flops_per_iteration(_config(activation="gelu"), B)
    assert swiglu - gelu == 3 * B * L * (2 * s * h * f)


def test_gelu_tanh_counts_like_gelu():
    assert model_flops_per_iteration(_config(activation="gelu_tanh"), 3) == model_flops_per_iteration(
        _config(activation="gelu"), 3
    )


def test_kv_channels_sizes_the_attention_not_the_hidden():
    # Qwen3-style: 4 heads of d=24 (96 != h=64), 2 KV heads; only the attention terms change.
    B, s, h, heads, kv, L = 3, 32, 64, 4, 2, 2
    per_d = 2 * s * h * (heads + 2 * kv) + 2 * heads * 2 * s * s / 2 + 2 * s * heads * h  # per unit of d
    wide = model_flops_per_iteration(_config(kv_channels=24), B)
    assert wide - model_flops_per_iteration(_config(), B) == 3 * B * L * per_d * (24 - 16)


def test_recompute_is_not_model_flops():
    assert model_flops_per_iteration(_config(recompute="full"), 3) == model_flops_per_iteration(_config(), 3)


def test_llama3_8b_matches_the_published_megatron_figure():
    # Megatron Bridge, Llama 3 8B, seq 8192: 14,451 tokens/s/GPU reported as 744 TFLOP/s/GPU.
    c = _config(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        padded_vocab_size=128256,
        seq_length=8192,
    )
    per_token = model_flops_per_iteration(c, 1) / 8192
    assert per_token * 14451 == pytest.approx(744e12, rel=2e-3)


def test_mfu():
    assert mfu(1e15, 2.0, 4, 250e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive step time"):
        mfu(1e15, 0.0, 4, 250e12)


@pytest.mark.parametrize(
    "name, dtype, value, source",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12, "table:H100"),
        ("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn, 1979e12, "table:H100"),
        ("NVIDIA H200", torch.bfloat16, 989e12, "table:H200"),
        ("NVIDIA H200", torch.float16, 989e12, "table:H200"),
        ("NVIDIA H200", torch.float8_e5m2, 1979e12, "table:H200"),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12, "table:A100"),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12, "table:H100-PCIe"),
    ],
)
def test_gpu_table(name, dtype, value, source, tmp_path):
    def no_measure(*_):
        raise AssertionError("a table GPU is not measured")

    peak = peak_flops("cuda", dtype, device_name=name, cache_path=tmp_path / "c.json", measure=no_measure)
    assert peak == PeakFlops(value, source)


def test_gpu_fp32_follows_the_tf32_setting():
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert flops.gpu_peak_from_table("NVIDIA H200", torch.float32).flops_per_s == 67e12
        torch.set_float32_matmul_precision("high")
        assert flops.gpu_peak_from_table("NVIDIA H200", torch.float32).flops_per_s == 494.5e12
    finally:
        torch.set_float32_matmul_precision(previous)


def test_unknown_gpu_is_measured_and_cached(tmp_path):
    calls = []

    def fake(device_type, dtype):
        calls.append((device_type, dtype))
        return 123e12

    cache = tmp_path / "peak.json"
    for expected_source in ("measured", "measured:cache"):
        peak = peak_flops("cuda", torch.bfloat16, device_name="NVIDIA L4", cache_path=cache, measure=fake)
        assert peak == PeakFlops(123e12, expected_source)
    assert calls == [("cuda", torch.bfloat16)]
    assert flops.gpu_peak_from_table("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn) is None  # no fp8


def test_cpu_peak_is_measured_once_then_read_from_the_cache(tmp_path):
    calls = []

    def fake(device_type, dtype):
        calls.append((device_type, dtype))
        return 1.5e11

    cache = tmp_path / "sub" / "peak_flops.json"
    first = peak_flops("cpu", torch.float32, cache_path=cache, measure=fake)
    assert first == PeakFlops(1.5e11, "measured")
    (key,) = json.loads(cache.read_text())
    assert key.startswith(f"cpu|{flops.cpu_model_name()}|threads={torch.get_num_threads()}|torch.float32|")

    second = peak_flops("cpu", torch.float32, cache_path=cache, measure=fake)
    assert second == PeakFlops(1.5e11, "measured:cache")
    assert len(calls) == 1  # the second call did not measure

    peak_flops("cpu", torch.bfloat16, cache_path=cache, measure=fake)  # another dtype: another key
    assert len(calls) == 2 and len(json.loads(cache.read_text())) == 2


def test_cpu_cache_key_includes_thread_count(tmp_path):
    cache = tmp_path / "peak.json"
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        peak_flops("cpu", torch.float32, cache_path=cache, measure=lambda *_: 1e10)
        torch.set_num_threads(2)
        peak = peak_flops("cpu", torch.float32, cache_path=cache, measure=lambda *_: 2e10)
    finally:
        torch.set_num_threads(previous)
    assert peak == PeakFlops(2e10, "measured")


def test_corrupt_cache_is_remeasured(tmp_path):
    cache = tmp_path / "peak.json"
    cache.write_text("{not json")
    peak = peak_flops("cpu", torch.float32, cache_path=cache, measure=lambda *_: 7e9)
    assert peak == PeakFlops(7e9, "measured")
    assert len(json.loads(cache.read_text())) == 1


def test_default_cache_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert flops.default_cache_path() == tmp_path / "elastron" / "peak_flops.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert flops.default_cache_path() == tmp_path / "home" / ".cache" / "elastron" / "peak_flops.json"


def test_a_real_cpu_measurement_is_positive():
    assert flops.measure_matmul_flops("cpu", torch.float32, max_size=256, repeats=1) > 0
    with pytest.raises(ValueError, match="cannot measure"):
        flops.measure_matmul_flops("cpu", torch.int32)


def test_moe_layers_count_the_router_and_the_k_experts_a_token_visits():
    from engine.jobspec import parse_job
    from engine.transformer.config import TransformerConfig

    def config(moe):
        model = {
            "arch": "llama",
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "seq_length": 16,
        }
        if moe:
            model["moe"] = moe
        return TransformerConfig.from_job(parse_job({"model": model}), 257)

    dense = config(None)
    moe = config(
        {
            "num_experts": 8,
            "top_k": 2,
            "ffn_hidden_size": 32,
            "layer_freq": 2,
            "shared_expert_ffn_hidden_size": 16,
        }
    )
    h, f = 64, dense.ffn_hidden_size
    # Layer 0 is MoE (freq 2), layer 1 dense: per token, the MoE layer swaps the dense MLP for the
    # router, 2 experts of width 32 and a shared expert of width 16 (SwiGLU: 3 matrices each).
    per_token_delta = (2 * h * 8 + 2 * (2 * h * 32 * 3) + 2 * h * 16 * 3) - 2 * h * f * 3
    delta = model_flops_per_iteration(moe, 4) - model_flops_per_iteration(dense, 4)
    assert delta == pytest.approx(3 * 4 * 16 * per_token_delta)


def test_mla_and_mtp_hand_count():
    """MLA (h=64, a=4, q_r=24, kv_r=16, nope 8, rope 4, v 12) and one MTP depth, each GEMM
    written out for one sequence of s=32 tokens."""
    from engine.jobspec.model import MLASpec

    mla = MLASpec(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
    s, h, a, f, V, L = 32, 64, 4, 96, 128, 2
    attention = (
        2 * s * h * 24  # q down
        + 2 * s * 24 * a * 12  # q up: a heads of nope + rope
        + 2 * s * h * (16 + 4)  # kv down + the shared RoPE key
        + 2 * s * 16 * a * (8 + 12)  # kv up: k_nope and v per head
        + a * 2 * s * 12 * s / 2  # QK^T over nope + rope, causal half
        + a * 2 * s * s * 12 / 2  # probabilities x V over v, causal half
        + 2 * s * (a * 12) * h  # output projection
    )
    mlp = 3 * 2 * s * h * f
    logits = 2 * s * h * V
    depth = 2 * s * (2 * h) * h + attention + mlp + logits  # eh_proj, one layer, its logits
    want = 3 * 5 * (L * (attention + mlp) + logits + depth)
    got = model_flops_per_iteration(_config(mla=mla, mtp_num_layers=1), 5)
    assert got == pytest.approx(want)


def test_a_bidirectional_encoder_counts_every_attention_score():
    """BERT attends over all s x s scores: its count is the decoder's with the full matrix."""
    import dataclasses

    from engine.jobspec import JobSpec
    from engine.transformer.config import TransformerConfig

    spec = JobSpec.model_validate(
        {"name": "b", "model": {"arch": "bert", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "seq_length": 32, "vocab_size": 261},
         "data": {"source": "synthetic"}}
    )  # fmt: skip
    encoder = TransformerConfig.from_job(spec, 261)
    assert not encoder.causal
    decoder = dataclasses.replace(encoder, causal=True)
    from engine.flops import model_flops_per_iteration as count

    assert count(encoder, 8) == count(decoder, 8, full_attention_matrix=True) > count(decoder, 8)
