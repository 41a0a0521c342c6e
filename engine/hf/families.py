"""Per-family tensor mapping between a Hugging Face causal LM and our GPTModel's global names.

Our names are `GPTModel.global_param_name`'s (layer numbers global, tied output = embedding,
experts numbered globally). Each of our tensors is, along its first dimension, a concatenation
of `Segment`s (segment.py): row ranges of Hugging Face tensors (or zero rows: the vocabulary
padding). Import reads, for the rows a rank holds, the overlapping part of each segment; export
cuts the full tensor back into segments and puts each HF tensor together from its pieces. So one
table per family drives both directions and every layout. Fused tensors use Megatron-Core's layouts:

- `linear_qkv` is [groups x (q_per_group + 2) x head_dim, hidden]: per query group its queries,
  then its key, then its value, so a TP shard is a block of whole groups and reads contiguous row
  ranges of HF's q_proj / k_proj / v_proj (GPT-2's c_attn is [q; k; v] over all heads);
- `linear_fc1` is [gate; up] (SwiGLU): TP rank r holds gate shard r then up shard r.

GPT-2 stores its linears as Conv1D ([in, out]); its segments are `transposed`. Which families
exist and how each names its tensors (`layout`, `moe`) is the registry's,
engine/jobspec/hf_families.py (plain data, shared with the config.json side the API uses).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from engine.hf.bert_tensors import bert_segments
from engine.hf.segment import Heads, Segment, Shapes, grouped_qkv, vocab, whole
from engine.hf.t5 import t5_segments
from engine.jobspec.hf_families import family

# Model state that only some families store: the aux-loss-free expert bias (DeepSeek-V3's
# e_score_correction_bias; zero and left out for the others).
NOT_WEIGHTS = (".mlp.router.expert_bias",)


def interleaved_rope_order(dim: int) -> tuple[int, ...]:
    """DeepSeek's checkpoints store RoPE dimensions interleaved (x0, y0, x1, y1, ...; its
    `rope_interleave`); ours rotate halves (x0, x1, ..., y0, y1, ...): our row i is HF row order[i]."""
    return tuple(range(0, dim, 2)) + tuple(range(1, dim, 2))


def _gpt2_qkv(name: str, h: Heads, transposed: bool) -> list[Segment]:
    """GPT-2's c_attn is [q; k; v] over all heads (one query group per head)."""
    d, n = h.head_dim, h.num_attention_heads
    out = []
    for g in range(n):
        out += [Segment(name, off + g * d, d, transposed) for off in (0, n * d, 2 * n * d)]
    return out


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def _llama_layer(prefix: str, suffix: str, s: Shapes, arch: str) -> list[Segment]:
    h, hidden = s.heads, s.hidden_size
    attn = f"{prefix}.self_attn"
    qkv = (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj")
    mixtral = family(arch).moe == "mixtral"  # block_sparse_moe, experts' w1/w3/w2
    moe = f"{prefix}.block_sparse_moe" if mixtral else f"{prefix}.mlp"
    table: dict[str, list[Segment]] = {
        "input_layernorm.weight": whole(f"{prefix}.input_layernorm.weight", hidden),
        "pre_mlp_layernorm.weight": whole(f"{prefix}.post_attention_layernorm.weight", hidden),
        "self_attention.linear_qkv.weight": grouped_qkv(*(f"{n}.weight" for n in qkv), h),
        "self_attention.linear_qkv.bias": grouped_qkv(*(f"{n}.bias" for n in qkv), h),
        "self_attention.linear_proj.weight": whole(f"{attn}.o_proj.weight", hidden),
        "self_attention.q_layernorm.weight": whole(f"{attn}.q_norm.weight", h.head_dim),
        "self_attention.k_layernorm.weight": whole(f"{attn}.k_norm.weight", h.head_dim),
        "mlp.linear_fc1.weight": [
            Segment(f"{prefix}.mlp.gate_proj.weight", 0, s.ffn_hidden_size),
            Segment(f"{prefix}.mlp.up_proj.weight", 0, s.ffn_hidden_size),
        ],
        "mlp.linear_fc2.weight": whole(f"{prefix}.mlp.down_proj.weight", hidden),
        "mlp.router.weight": [Segment(f"{moe}.gate.weight", 0, -1)],
    }
    if suffix in table:
        return table[suffix]
    e = _EXPERT.match(suffix)
    if e:
        j, which, f = e.group(1), e.group(2), s.expert_ffn_hidden_size
        if mixtral:
            gate, up, down = (f"{moe}.experts.{j}.{w}.weight" for w in ("w1", "w3", "w2"))
        else:
            gate, up, down = (f"{moe}.experts.{j}.{w}_proj.weight" for w in ("gate", "up", "down"))
        if which == "linear_fc1":
            return [Segment(gate, 0, f), Segment(up, 0, f)]
        return whole(down, hidden)
    raise KeyError(suffix)


def _deepseek_layer(prefix: str, suffix: str, s: Shapes) -> list[Segment]:
    """DeepSeek-V3: multi-latent attention, dense first layers, group-routed experts with a
    score-correction bias (our expert_bias) and an ungated shared expert."""
    mla, heads, hidden = s.mla, s.heads.num_attention_heads, s.hidden_size
    nope, rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
    order = interleaved_rope_order(rope) if s.rope_interleave else None
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"

    def per_head_q(name: str) -> list[Segment]:
        out = []
        for i in range(heads):
            out += [
                Segment(name, i * (nope + rope), nope),
                Segment(name, i * (nope + rope) + nope, rope, order=order),
            ]
        return out

    shared = s.shared_expert_ffn_hidden_size
    table = {
        "input_layernorm.weight": whole(f"{prefix}.input_layernorm.weight", hidden),
        "pre_mlp_layernorm.weight": whole(f"{prefix}.post_attention_layernorm.weight", hidden),
        "self_attention.linear_q_proj.weight": per_head_q(f"{attn}.q_proj.weight"),
        "self_attention.linear_q_down_proj.weight": [Segment(f"{attn}.q_a_proj.weight", 0, -1)],
        "self_attention.q_layernorm.weight": [Segment(f"{attn}.q_a_layernorm.weight", 0, -1)],
        "self_attention.linear_q_up_proj.weight": per_head_q(f"{attn}.q_b_proj.weight"),
        "self_attention.linear_kv_down_proj.weight": [
            Segment(f"{attn}.kv_a_proj_with_mqa.weight", 0, mla.kv_lora_rank),
            Segment(f"{attn}.kv_a_proj_with_mqa.weight", mla.kv_lora_rank, rope, order=order),
        ],
        "self_attention.kv_layernorm.weight": whole(f"{attn}.kv_a_layernorm.weight", mla.kv_lora_rank),
        "self_attention.linear_kv_up_proj.weight": [Segment(f"{attn}.kv_b_proj.weight", 0, -1)],
        "self_attention.linear_proj.weight": whole(f"{attn}.o_proj.weight", hidden),
        "mlp.linear_fc1.weight": [
            Segment(f"{mlp}.gate_proj.weight", 0, s.ffn_hidden_size),
            Segment(f"{mlp}.up_proj.weight", 0, s.ffn_hidden_size),
        ],
        "mlp.linear_fc2.weight": whole(f"{mlp}.down_proj.weight", hidden),
        "mlp.router.weight": [Segment(f"{mlp}.gate.weight", 0, -1)],
        "mlp.router.expert_bias": [Segment(f"{mlp}.gate.e_score_correction_bias", 0, -1)],
    }
    if shared:
        table["mlp.shared_expert.linear_fc1.weight"] = [
            Segment(f"{mlp}.shared_experts.gate_proj.weight", 0, shared),
            Segment(f"{mlp}.shared_experts.up_proj.weight", 0, shared),
        ]
        table["mlp.shared_expert.linear_fc2.weight"] = whole(
            f"{mlp}.shared_experts.down_proj.weight", hidden
        )
    if suffix in table:
        return table[suffix]
    e = _EXPERT.match(suffix)
    if e:
        j, which, f = e.group(1), e.group(2), s.expert_ffn_hidden_size
        if which == "linear_fc1":
            return [
                Segment(f"{mlp}.experts.{j}.gate_proj.weight", 0, f),
                Segment(f"{mlp}.experts.{j}.up_proj.weight", 0, f),
            ]
        return whole(f"{mlp}.experts.{j}.down_proj.weight", hidden)
    raise KeyError(suffix)


def _deepseek_mtp(depth: int, suffix: str, s: Shapes) -> list[Segment]:
    """MTP depth k is DeepSeek-V3's layer num_layers + k: enorm, hnorm, eh_proj (its input is
    [enorm(embedding); hnorm(hidden)], as ours), a decoder layer, and shared_head.norm (our
    final_layernorm); its embed_tokens and shared_head.head copies of the shared embedding and
    output layer are not ours to read (our depths share the model's own)."""
    prefix = f"model.layers.{s.num_layers + depth}"
    own = {
        "enorm.weight": whole(f"{prefix}.enorm.weight", s.hidden_size),
        "hnorm.weight": whole(f"{prefix}.hnorm.weight", s.hidden_size),
        "eh_proj.weight": whole(f"{prefix}.eh_proj.weight", s.hidden_size),
        "final_layernorm.weight": whole(f"{prefix}.shared_head.norm.weight", s.hidden_size),
    }
    if suffix in own:
        return own[suffix]
    if suffix.startswith("transformer_layer."):
        return _deepseek_layer(prefix, suffix.removeprefix("transformer_layer."), s)
    raise KeyError(suffix)


def _gpt2_layer(prefix: str, suffix: str, s: Shapes) -> list[Segment]:
    hidden, ffn = s.hidden_size, s.ffn_hidden_size
    table = {
        "input_layernorm.weight": whole(f"{prefix}.ln_1.weight", hidden),
        "input_layernorm.bias": whole(f"{prefix}.ln_1.bias", hidden),
        "pre_mlp_layernorm.weight": whole(f"{prefix}.ln_2.weight", hidden),
        "pre_mlp_layernorm.bias": whole(f"{prefix}.ln_2.bias", hidden),
        "self_attention.linear_qkv.weight": _gpt2_qkv(f"{prefix}.attn.c_attn.weight", s.heads, True),
        "self_attention.linear_qkv.bias": _gpt2_qkv(f"{prefix}.attn.c_attn.bias", s.heads, False),
        "self_attention.linear_proj.weight": [Segment(f"{prefix}.attn.c_proj.weight", 0, hidden, True)],
        "self_attention.linear_proj.bias": whole(f"{prefix}.attn.c_proj.bias", hidden),
        "mlp.linear_fc1.weight": [Segment(f"{prefix}.mlp.c_fc.weight", 0, ffn, True)],
        "mlp.linear_fc1.bias": whole(f"{prefix}.mlp.c_fc.bias", ffn),
        "mlp.linear_fc2.weight": [Segment(f"{prefix}.mlp.c_proj.weight", 0, hidden, True)],
        "mlp.linear_fc2.bias": whole(f"{prefix}.mlp.c_proj.bias", hidden),
    }
    if suffix in table:
        return table[suffix]
    raise KeyError(suffix)


def segments(arch: str, our_name: str, s: Shapes) -> list[Segment]:
    """Our global tensor `our_name` as HF segments along its first dimension; KeyError when the
    family has no tensor for it (a model feature the family lacks)."""
    layout = family(arch).layout
    if layout == "bert":
        return bert_segments(our_name, s)
    if layout == "t5":  # engine/hf/t5.py (built from the same pieces, segment.py)
        return t5_segments(our_name, s)
    gpt2 = layout == "gpt2"
    m = _LAYER.match(our_name)
    if m:
        idx, suffix = m.groups()
        prefix = f"transformer.h.{idx}" if gpt2 else f"model.layers.{idx}"
        if gpt2:
            return _gpt2_layer(prefix, suffix, s)
        if layout == "deepseek":
            return _deepseek_layer(prefix, suffix, s)
        return _llama_layer(prefix, suffix, s, arch)
    m = _MTP.match(our_name)
    if m and layout == "deepseek":
        return _deepseek_mtp(int(m.group(1)), m.group(2), s)
    embed = "transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"
    if our_name == "embedding.weight" or (our_name == "output_layer.weight" and s.tie_embeddings):
        return vocab(embed, s)
    if our_name == "output_layer.weight":
        return vocab("lm_head.weight", s)
    if gpt2 and our_name == "position_embeddings.weight":
        return [Segment("transformer.wpe.weight", 0, -1)]
    final = {"decoder.final_layernorm.weight": "weight", "decoder.final_layernorm.bias": "bias"}
    if our_name in final:
        return whole(f"{'transformer.ln_f' if gpt2 else 'model.norm'}.{final[our_name]}", s.hidden_size)
    raise KeyError(our_name)


def hf_names(arch: str, our_name: str, s: Shapes) -> list[str]:
    """The HF tensors one of our tensors is made of, in order, without repeats."""
    return list(dict.fromkeys(seg.name for seg in segments(arch, our_name, s) if seg.name is not None))


def resolve_lengths(segs: list[Segment], rows: int) -> list[Segment]:
    """Segments with a length of -1 ("all rows of the HF tensor") given the tensor's row count."""
    return [dataclasses.replace(g, length=rows) if g.length < 0 else g for g in segs]


def hf_tensors(arch: str, our: dict[str, torch.Tensor], s: Shapes) -> dict[str, torch.Tensor]:
    """Export: our full global tensors -> HF tensors (padding rows dropped, fused ones split)."""
    pieces: dict[str, list[tuple[int, torch.Tensor, bool]]] = {}
    for name, full in our.items():
        try:
            segs = segments(arch, name, s)
        except KeyError:
            if name.endswith(NOT_WEIGHTS):  # state this family has no tensor for
                continue
            raise
        row = 0
        for seg in resolve_lengths(segs, full.shape[0]):
            part = full.narrow(0, row, seg.length)
            if seg.order is not None:  # back to HF's row order: hf[order[i]] = ours[i]
                part = part[torch.tensor(seg.order).argsort()]
            row += seg.length
            if seg.name is not None:
                pieces.setdefault(seg.name, []).append((seg.start, part, seg.transposed))
        if row != full.shape[0]:
            raise ValueError(f"{name}: {full.shape[0]} rows, but its segments cover {row}")
    out = {}
    for hf, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        starts = [p[0] for p in parts]
        if len(set(starts)) != len(starts):  # a tied embedding reached twice: keep one
            parts = list({p[0]: p for p in parts}.values())
        joined = torch.cat([p[1] for p in parts], dim=0)
        out[hf] = joined.t().contiguous() if parts[0][2] else joined.contiguous()
    return out
