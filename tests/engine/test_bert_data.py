"""`data.source: mlm` against its definition (engine/data/mlm.py), and the job rules of arch bert.

Statistics: over 600 samples of 32 tokens (~18 000 candidate tokens) the selected share is
mask_prob within 4 binomial standard deviations, and of the selected tokens 80 / 10 / 10 % are
[MASK] / a random token / kept, each within 4 standard deviations. The samples are seeded, so
the test is deterministic; 4 sigma means a correct sampler fails it for ~1 seed in 16 000.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from engine.data.builder import build_datasets
from engine.data.mlm import MLMSource
from engine.data.preprocess import preprocess
from engine.data.sft import IGNORE_INDEX
from engine.data.sources import SHIPPED_CORPUS
from engine.data.tokenizer import build_tokenizer
from engine.jobspec import DataSpec, JobSpec

SEQ = 32
RESERVED = {"cls_id": 257, "sep_id": 258, "pad_id": 259, "mask_id": 260}
WHITESPACE = torch.tensor([9, 10, 11, 12, 13, 32])


def _source(seed: int = 5, tokenizer: str = "byte", vocab: int = 261, **mlm) -> MLMSource:
    data = DataSpec(source="mlm", tokenizer=tokenizer, mlm={**(RESERVED if tokenizer == "byte" else {}), **mlm})
    return build_datasets(data, build_tokenizer(tokenizer), SEQ, seed, synthetic_vocab_size=vocab).train


def _within(count: int, n: int, p: float, what: str) -> None:
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(count / n - p) < 4 * sigma, f"{what}: {count}/{n} = {count / n:.4f}, expected {p} +- {4 * sigma:.4f}"


def test_masking_statistics_follow_the_definition():
    src = _source()
    candidates = selected = masked = random = kept = 0
    for i in range(600):
        original = src.tokens(i)
        tokens, labels, attention = src.sample(i)
        assert tokens.shape == labels.shape == (SEQ,) and bool(attention.all())
        assert original[0] == 257 and original[-1] == 258  # [CLS] ... [SEP]
        special = torch.isin(original, torch.tensor([257, 258, 259]))
        chosen = labels != IGNORE_INDEX
        assert not bool((chosen & special).any()), "a special token was selected"
        assert torch.equal(labels[chosen], original[chosen])  # the label is the original token
        assert torch.equal(tokens[~chosen], original[~chosen])  # the rest is untouched
        candidates += int((~special).sum())
        selected += int(chosen.sum())
        masked += int((tokens[chosen] == 260).sum())
        kept += int((tokens[chosen] == original[chosen]).sum())
        random += int(((tokens[chosen] != 260) & (tokens[chosen] != original[chosen])).sum())
        assert bool((tokens[chosen & (tokens != 260)] < 257).all())  # random tokens: the tokenizer's
    _within(selected, candidates, 0.15, "selected share")
    _within(masked, selected, 0.8, "[MASK] share")
    # a random replacement equal to the original (1 in 257) counts as kept
    _within(random, selected, 0.1 * 256 / 257, "random share")
    _within(kept, selected, 0.1 + 0.1 / 257, "kept share")


def test_samples_are_fixed_by_their_index_on_any_layout():
    a, b = _source(), _source()
    whole = a.micro_batch(40, 1, 4, 1, 0)  # samples 44..47
    halves = [b.micro_batch(40, 1, 2, 2, r) for r in (0, 1)]
    assert torch.equal(whole.tokens, torch.cat([h.tokens for h in halves]))
    assert torch.equal(whole.labels, torch.cat([h.labels for h in halves]))
    assert torch.equal(whole.inputs["attention_mask"], torch.ones(4, SEQ, dtype=torch.long))
    assert torch.equal(whole.inputs["token_type_ids"], torch.zeros(4, SEQ, dtype=torch.long))
    assert a.model_inputs == ("attention_mask", "token_type_ids")
    assert not torch.equal(_source(seed=6).micro_batch(40, 1, 4, 1, 0).labels, whole.labels)


def test_sentence_pairs():
    src, plain = _source(next_sentence=True), _source()
    assert src.model_inputs == ("attention_mask", "token_type_ids", "next_sentence_label")
    checked = 0
    for i in range(400):
        tokens, types, label = src.pair(i)
        seps = (tokens == 258).nonzero().flatten()
        assert tokens[0] == 257 and tokens[-1] == 258 and tokens.shape == (SEQ,)
        window = plain.windows[i][: SEQ - 3]
        cut = int(seps[0]) - 1 if bool((window != 256).all()) else None  # EOD-free windows: the first [SEP] is the cut
        if cut is None:
            continue
        assert torch.equal(types, (torch.arange(SEQ) >= cut + 2).long())  # 0: [CLS] A [SEP]; 1: B [SEP]
        assert torch.equal(tokens[1 : cut + 1], window[:cut])  # A: the window's start
        follows = torch.equal(tokens[cut + 2 : -1], window[cut:])
        if label == 0 or SEQ - 3 - cut >= 4:  # a random B of 1-3 tokens may equal the continuation
            assert follows == (label == 0), (i, label)  # a random B is another window's start
        checked += 1
    batch = src.micro_batch(0, 0, 4, 1, 0)
    assert batch.inputs["next_sentence_label"].shape == (4,)
    assert torch.equal(batch.inputs["token_type_ids"][0], src.pair(0)[1])
    _within(sum(src.pair(i)[2] for i in range(400)), 400, 0.5, "random-next share")
    assert checked > 200, checked  # most windows hold no document end


def test_whole_word_masking_selects_words():
    src = _source(whole_word=True)
    words = selected_words = 0
    for i in range(300):
        original = src.tokens(i)
        _, labels, _ = src.sample(i)
        chosen = labels != IGNORE_INDEX
        space = torch.isin(original, WHITESPACE) | torch.isin(original, torch.tensor([257, 258]))
        word: list[int] = []
        for pos in range(SEQ + 1):
            if pos == SEQ or space[pos]:
                if word:
                    picks = {bool(chosen[p]) for p in word}
                    assert len(picks) == 1, f"sample {i}: word at {word} partly selected"
                    words += 1
                    selected_words += picks.pop()
                word = []
                if pos < SEQ:
                    assert not chosen[pos] or not torch.isin(original[pos], torch.tensor([257, 258]))
            else:
                word.append(pos)
    _within(selected_words, words, 0.15, "selected share of words")


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("wordpiece")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train([str(SHIPPED_CORPUS)], trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials, show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_a_wordpiece_tokenizer_gives_the_ids_and_the_words(wordpiece, tmp_path):
    spec = f"hf:{wordpiece}"
    src = _source(tokenizer=spec, vocab=400, whole_word=True)
    assert src.ids == {"cls_id": 2, "sep_id": 3, "pad_id": 0, "mask_id": 4}
    tok = build_tokenizer(spec)
    assert tok.eod == 3  # [SEP] ends a document
    continuation = torch.tensor([tok._tok.id_to_token(i).startswith("##") for i in range(400)])
    pieces = 0
    for i in range(200):
        original = src.tokens(i)
        chosen = src.sample(i)[1] != IGNORE_INDEX
        cont = continuation[original]
        cont[0] = False
        cont[1:] &= ~torch.isin(original[:-1], torch.tensor([0, 2, 3]))  # after [CLS]/[SEP]: a word starts
        # a continuation piece is selected exactly when the piece before it is
        assert torch.equal(chosen[1:][cont[1:]], chosen[:-1][cont[1:]]), f"sample {i}"
        pieces += int(cont.sum())
    assert pieces > 500  # the check above saw many words of several pieces
    # the indexed corpus: the same text preprocessed, masked the same way
    preprocess([SHIPPED_CORPUS], spec, tmp_path / "corpus", progress=False)
    data = DataSpec(source="mlm", tokenizer=spec, path=str(tmp_path / "corpus"), mlm={"corpus": "indexed"}, split=[9, 1])
    ds = build_datasets(data, tok, SEQ, 5, synthetic_vocab_size=400)
    assert isinstance(ds.train, MLMSource) and isinstance(ds.valid, MLMSource)
    tokens, labels, _ = ds.train.sample(3)
    assert tokens[0] == 2 and tokens[-1] == 3 and bool((labels != IGNORE_INDEX).any())


def test_special_ids_are_checked():
    with pytest.raises(ValueError, match=r"data\.mlm\.cls_id: the tokenizer \(byte\) has no \[CLS\] token: set data\.mlm\.cls_id"):
        build_datasets(DataSpec(source="mlm"), build_tokenizer("byte"), SEQ, 5, synthetic_vocab_size=261)
    with pytest.raises(ValueError, match=r"data\.mlm\.mask_id \(260\) is outside the model's vocabulary of 260 ids"):
        _source(vocab=260)
    with pytest.raises(ValidationError, match="special token ids must differ"):
        DataSpec(source="mlm", mlm={"cls_id": 3, "sep_id": 3})


def _job(**changes) -> dict:
    job = {
        "name": "bert",
        "model": {"arch": "bert", "vocab_size": 261, "seq_length": SEQ},
        "data": {"source": "mlm", "mlm": RESERVED},
        "resources": {"ranks": 1, "device": "cpu"},
    }
    for key, value in changes.items():
        job[key] = {**job.get(key, {}), **value}
    return job


def test_job_rules():
    spec = JobSpec.model_validate(_job())
    m = spec.model
    assert (m.activation, m.qkv_bias, m.tie_embeddings, m.type_vocab_size) == ("gelu", True, True, 2)
    assert spec.data.mlm.mask_prob == 0.15 and spec.data.mlm.corpus == "text"
    refused = {
        "parallel.context > 1 is not supported with arch bert": _job(parallel={"context": 2}, resources={"ranks": 2}),
        "arch bert trains on data.source: mlm": _job(data={"source": "text", "mlm": None}),
        "data.source mlm makes masked-LM samples for arch bert": _job(model={"arch": "llama"}),
        "model.moe is not supported with arch bert": _job(model={"moe": {"num_experts": 2}}),
        "must equal model.num_attention_heads": _job(model={"num_query_groups": 2}),
        "model.type_vocab_size applies to arch bert only": _job(model={"arch": "gpt2", "type_vocab_size": 2}),
        "model.bert_binary_head and data.mlm.next_sentence go together": _job(model={"bert_binary_head": True}),
        "model.seq_length \\(4\\) is too short": _job(model={"seq_length": 4}),
        "data.mlm applies to data.source mlm only": _job(model={"arch": "gpt2"}, data={"source": "text"}),
    }
    for message, job in refused.items():
        with pytest.raises(ValidationError, match=message):
            JobSpec.model_validate(job)
    from engine.jobspec.hf_families import HFConfigError
    from engine.jobspec.hf_fields import check_sliding_window

    with pytest.raises(HFConfigError, match="max_position_embeddings=16 is smaller than model.seq_length=32"):
        check_sliding_window({"model_type": "bert", "max_position_embeddings": 16}, SEQ)
    check_sliding_window({"model_type": "bert", "max_position_embeddings": 32}, SEQ)
