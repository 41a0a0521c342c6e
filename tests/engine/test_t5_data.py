"""model.arch t5's data and job rules, no process group: span corruption against T5's definition
(exact noise and span counts, the segmentation's distribution, reconstruction, sentinels,
determinism by sample index), seq2seq pairs (formats, errors, the batch layout), the job rules
that refuse what T5 cannot run, and config.json both ways."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.data.builder import build_datasets
from engine.data.seq2seq import Seq2SeqSource, load_pairs, seq2seq_batch
from engine.data.sft import IGNORE_INDEX
from engine.data.span_corruption import SpanCounts, corrupt, noise_mask, raw_length_for, sentinel_ids
from engine.data.tokenizer import ByteTokenizer
from engine.jobspec import parse_job
from engine.jobspec.hf_families import FAMILIES, HFConfigError
from engine.jobspec.hf_fields import hf_model_fields
from engine.jobspec.hf_t5 import t5_hf_config

VOCAB = 300


def _spans(mask: list[bool]) -> list[int]:
    """Lengths of the runs of True."""
    out, run = [], 0
    for m in [*mask, False]:
        if m:
            run += 1
        elif run:
            out.append(run)
            run = 0
    return out


def test_lengths_follow_t5():
    # T5's compute_input_and_target_lengths for 512 inputs: 568 raw tokens, 114 targets.
    raw = raw_length_for(512)
    assert raw == 568 and SpanCounts.of(raw).input_length == 512 and SpanCounts.of(raw).target_length == 114
    for seq in (16, 33, 128):
        raw = raw_length_for(seq)
        assert SpanCounts.of(raw).input_length <= seq < SpanCounts.of(raw + 1).input_length


def test_noise_and_span_counts_are_exact_and_segmentation_uniform():
    """Every window of 141 tokens: 21 noise tokens (15 %, rounded) in 7 spans (mean length 3),
    starting with kept tokens and ending with noise. The first span's length follows the uniform
    segmentation of 21 items into 7 non-empty runs: P(len = j) = C(20 - j, 5) / C(20, 6); its
    empirical frequency over N draws is within 4.5 binomial standard deviations for each j."""
    length, n = 141, 3000
    c = SpanCounts.of(length)
    assert (c.noise, c.spans) == (21, 7)
    first = []
    position_noise = torch.zeros(length)
    for i in range(n):
        mask = noise_mask(length, torch.Generator().manual_seed(i))
        spans = _spans(mask.tolist())
        assert int(mask.sum()) == 21 and len(spans) == 7 and sum(spans) / len(spans) == 3.0
        assert not mask[0] and mask[-1]
        first.append(spans[0])
        position_noise += mask.float()
    for j in range(1, 8):
        p = math.comb(20 - j, 5) / math.comb(20, 6)
        got = sum(x == j for x in first) / n
        assert abs(got - p) <= 4.5 * math.sqrt(p * (1 - p) / n), (j, got, p)
    # Overall 15 % noise; away from the ends each position is noise with about that probability.
    assert float(position_noise.sum()) / (n * length) == pytest.approx(21 / 141)
    middle = position_noise[20:120] / n
    assert float(middle.mean()) == pytest.approx(21 / 141, abs=4.5 * math.sqrt(0.15 * 0.85 / (n * 100)) + 0.02)


def test_corruption_reconstructs_the_window_with_descending_sentinels():
    ids = torch.randint(0, 257, (141,), generator=torch.Generator().manual_seed(0))
    mask = noise_mask(141, torch.Generator().manual_seed(5))
    inputs, targets = corrupt(ids, mask, list(range(VOCAB - 1, VOCAB - 8, -1)), eos=256)
    assert inputs[-1] == targets[-1] == 256
    assert len(inputs) == SpanCounts.of(141).input_length and len(targets) == SpanCounts.of(141).target_length
    sentinels = [t for t in inputs if t >= VOCAB - 7]
    assert sentinels == list(range(VOCAB - 1, VOCAB - 8, -1))
    # Put each span back at its sentinel: the original window.
    spans, current = {}, None
    for t in targets[:-1]:
        if t >= VOCAB - 7:
            current = t
            spans[t] = []
        else:
            spans[current].append(t)
    rebuilt = [x for t in inputs[:-1] for x in (spans[t] if t in spans else [t])]
    assert rebuilt == ids.tolist()


def test_span_corruption_source_is_deterministic_by_consumed_samples():
    spec = parse_job(
        {
            "model": {"arch": "t5", "seq_length": 32, "vocab_size": VOCAB},
            "data": {"source": "span_corruption"},
            "resources": {"ranks": 1, "device": "cpu"},
        }
    )
    a = build_datasets(spec, ByteTokenizer(), 32, 7, synthetic_vocab_size=VOCAB).train
    b = build_datasets(spec, ByteTokenizer(), 32, 7, synthetic_vocab_size=VOCAB).train
    assert a.model_inputs == ("decoder_input_ids", "attention_mask")
    # DP=2 x micro-batch 2 reads the same global batch as DP=1 x micro-batch 4.
    whole = a.micro_batch(8, 0, 4, 1, 0)
    halves = [b.micro_batch(8, 0, 2, 2, r) for r in range(2)]
    assert torch.equal(whole.tokens, torch.cat([h.tokens for h in halves]))
    assert torch.equal(whole.labels, torch.cat([h.labels for h in halves]))
    for k in whole.inputs:
        assert torch.equal(whole.inputs[k], torch.cat([h.inputs[k] for h in halves]))
    other = build_datasets(spec, ByteTokenizer(), 32, 8, synthetic_vocab_size=VOCAB).train
    assert not torch.equal(other.micro_batch(8, 0, 4, 1, 0).tokens, whole.tokens)
    # The decoder reads the targets shifted right behind the start id (0); labels pad with IGNORE.
    dec, labels = whole.inputs["decoder_input_ids"], whole.labels
    assert (dec[:, 0] == 0).all()
    kept = labels != IGNORE_INDEX
    assert torch.equal(dec[:, 1:][kept[:, 1:]], labels[:, :-1][kept[:, 1:]])
    assert (labels[kept] >= 0).all() and int(kept.sum(1).max()) == SpanCounts.of(raw_length_for(32)).target_length


def test_sentinels_must_lie_above_the_tokenizer_unless_it_has_t5s():
    spec = parse_job({"model": {"arch": "t5", "seq_length": 32}, "data": {"source": "span_corruption"}})
    with pytest.raises(ValueError, match=r"set model.vocab_size to at least 259"):
        build_datasets(spec, ByteTokenizer(), 32, 7, synthetic_vocab_size=257)
    assert sentinel_ids(ByteTokenizer(), 300, 128) == list(range(299, 292, -1))

    class WithExtraIds(ByteTokenizer):  # as HF's T5 tokenizers: <extra_id_k> is one token, 32099 - k
        def encode(self, text):
            return [32099 - int(text[10:-1])] if text.startswith("<extra_id_") else super().encode(text)

    assert sentinel_ids(WithExtraIds(), 32128, 128) == list(range(32099, 32092, -1))


def test_seq2seq_formats_and_batch(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [
        {"input": "translate: hello", "target": "bonjour"},
        {"prompt": "2+2?", "response": "4"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    pairs = load_pairs(path)
    assert pairs == [("translate: hello", "bonjour"), ("2+2?", "4"), ("<|user|>\nhi\n", "hello")]
    tok = ByteTokenizer()
    source = Seq2SeqSource(path, tok, 8, seed=1)
    batch = seq2seq_batch([source.samples[0]], 8, 0, 0)
    enc, target = source.samples[0]
    assert enc == tok.encode("transla") + [tok.eod] and target == tok.encode("bonjour") + [tok.eod]
    assert source.truncated == 2  # the first and the chat pair have inputs over 7 tokens
    assert batch.tokens[0].tolist() == enc and batch.inputs["attention_mask"][0].all()
    assert batch.inputs["decoder_input_ids"][0].tolist() == [0, *target[:-1]]
    assert batch.labels[0].tolist() == target


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "line 1: not valid JSON"),
        ('{"input": "a"}', "field 'target' is missing"),
        ('{"text": "a"}', "field 'input' is missing"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}', "must be the assistant"),
    ],
)
def test_seq2seq_errors_name_the_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_pairs(path)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"parallel": {"context": 2}}, "parallel.context"),
        ({"parallel": {"pipeline": 4}, "resources": {"ranks": 4}}, "parallel.pipeline"),
        ({"parallel": {"pipeline": 2, "pipeline_layers": [1, 1]}}, "parallel.pipeline"),
        ({"data": {"source": "sft", "path": "x.jsonl"}}, "data.source sft"),
        ({"model": {"arch": "t5", "moe": {"num_experts": 2}}}, "model.moe"),
        ({"model": {"arch": "t5", "activation": "swiglu"}}, "model.activation"),
        ({"model": {"arch": "llama"}}, "needs model.arch t5"),
        ({"model": {"arch": "llama", "t5": {}}}, "model.t5 applies"),
    ],
)
def test_job_rules_name_the_field(sections, message):
    spec = {"model": {"arch": "t5"}, "data": {"source": "span_corruption"}, "resources": {"ranks": 2}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    with pytest.raises(ValueError, match=message):
        parse_job(spec)


def test_pipeline_split_is_encoder_then_decoder():
    spec = parse_job(
        {
            "model": {"arch": "t5", "num_layers": 3, "t5": {"num_decoder_layers": 1}},
            "data": {"source": "span_corruption"},
            "parallel": {"pipeline": 2},
            "resources": {"ranks": 2},
        }
    )
    assert spec.model.t5.num_decoder_layers == 1 and spec.model.t5.scale_decoder_outputs is True


def test_config_json_both_ways():
    fam = FAMILIES["T5ForConditionalGeneration"]
    cfg = {
        "architectures": [fam.architecture],
        "vocab_size": 300,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 48,
        "num_layers": 2,
        "num_decoder_layers": 3,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 20,
        "layer_norm_epsilon": 1e-6,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "eos_token_id": 1,
    }
    fields = hf_model_fields(cfg)
    spec = parse_job({"model": {**fields, "seq_length": 16}, "data": {"source": "span_corruption"}})
    assert spec.model.t5.scale_decoder_outputs is False and not spec.model.tie_embeddings
    back = t5_hf_config(spec.model, fam, cfg, "fp32")
    assert {k: back[k] for k in cfg} == cfg
    with pytest.raises(HFConfigError, match="feed_forward_proj='relu'"):
        hf_model_fields({**cfg, "feed_forward_proj": "relu"})


def test_flops_count_matches_the_model_gemms():
    """engine/flops.py's T5 count (all scores counted) equals 3 x the FLOPs torch's counter sees in
    one forward of our model (no process group needed: one rank), plus the attention cores'
    QK^T and AV (2 x 2 x heads*head_dim x s x s per sequence and attention: the counter does not
    see them inside scaled_dot_product_attention on CPU)."""
    from torch.utils.flop_counter import FlopCounterMode

    from engine.flops import model_flops_per_iteration
    from engine.models.t5 import T5Model
    from engine.transformer.config import TransformerConfig

    spec = parse_job(
        {
            "model": {
                "arch": "t5",
                "num_layers": 2,
                "t5": {"num_decoder_layers": 3},
                "hidden_size": 32,
                "num_attention_heads": 4,
                "kv_channels": 16,
                "ffn_hidden_size": 40,
                "seq_length": 16,
                "vocab_size": VOCAB,
            },
            "data": {"source": "span_corruption"},
        }
    )
    config = TransformerConfig.from_job(spec, 257)
    model = T5Model(config)
    ids = torch.randint(0, VOCAB, (2, 16))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids, decoder_input_ids=ids, attention_mask=torch.ones(2, 16, dtype=torch.bool))
    cores = 2 * 2 * 2 * (4 * 16) * 16 * 16 * (2 + 2 * 3)  # batch 2; encoder self, decoder self + cross
    expected = model_flops_per_iteration(config, 2, full_attention_matrix=True)
    assert 3 * (counter.get_total_flops() + cores) == pytest.approx(expected, rel=1e-9)
