"""engine/hf/families.py: name mapping against a real LlamaForCausalLM, fused layouts per TP shard."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.hf.families import Heads, hf_names, pack_fc1, pack_qkv, qkv_source_rows, unpack_fc1, unpack_qkv


def _our_names(layers: int, tied: bool) -> list[str]:
    names = ["embedding.weight", "decoder.final_layernorm.weight"] + ([] if tied else ["output_layer.weight"])
    for i in range(layers):
        names += [
            f"decoder.layers.{i}.{s}"
            for s in (
                "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
            )
        ]
    return names


@pytest.mark.parametrize("tied", [False, True])
def test_names_cover_exactly_the_hf_state_dict(tied):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    hf = set(LlamaForCausalLM(cfg).state_dict())
    if tied:
        hf.discard("lm_head.weight")
    mapped = [n for ours in _our_names(2, tied) for n in hf_names(ours, tied)]
    assert len(mapped) == len(set(mapped)) and set(mapped) == hf
    with pytest.raises(KeyError, match="decoder.layers.0.bogus"):
        hf_names("decoder.layers.0.bogus", tied)


def test_qkv_and_fc1_tp_shards_are_contiguous_and_invertible():
    h, hidden, ffn = Heads(num_attention_heads=8, num_query_groups=4, head_dim=3), 5, 6
    q, k, v = torch.randn(8 * 3, hidden), torch.randn(4 * 3, hidden), torch.randn(4 * 3, hidden)
    full = pack_qkv(q, k, v, h)
    assert full.shape == (4 * (2 + 2) * 3, hidden)
    assert all(torch.equal(a, b) for a, b in zip(unpack_qkv(full, h), (q, k, v), strict=True))
    tp = 2
    for r in range(tp):
        qs, ks, vs = qkv_source_rows(h, range(r * 2, r * 2 + 2))
        shard = pack_qkv(q[qs], k[ks], v[vs], h)
        assert torch.equal(shard, full.chunk(tp, dim=0)[r])
    gate, up = torch.randn(ffn, hidden), torch.randn(ffn, hidden)
    fc1 = pack_fc1(gate, up)
    assert all(torch.equal(a, b) for a, b in zip(unpack_fc1(fc1), (gate, up), strict=True))
    # stride 2: rank r holds [gate shard r; up shard r]
    r_shard = pack_fc1(gate.chunk(tp)[1], up.chunk(tp)[1])
    assert torch.equal(r_shard, torch.cat([fc1[:ffn].chunk(tp)[1], fc1[ffn:].chunk(tp)[1]]))
