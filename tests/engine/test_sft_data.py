"""SFT data: chat-template rendering, the assistant-only loss mask, samples, bad lines, and the
ignore index in the (vocab-parallel) cross entropy."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine import parallel_state as ps
from engine.data.sft import (
    IGNORE_INDEX,
    ChatRenderer,
    SFTSource,
    load_conversations,
    read_chat_template,
    sft_micro_batch,
)
from engine.data.tokenizer import ByteTokenizer, HFTokenizer
from engine.launcher import spawn
from engine.tensor_parallel import vocab_parallel_cross_entropy
from tests.engine.data_helpers import CORPUS

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|endoftext|>"]
CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is a list?"},
            {"role": "assistant", "content": "A mutable sequence."},
            {"role": "user", "content": "And a tuple?"},
            {"role": "assistant", "content": "An immutable one."},
        ]
    },
    {"prompt": "Name a module.", "response": "The os module."},
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("llama3")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": LLAMA3_TEMPLATE,
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
            }
        )
    )
    return folder


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS) + "\n")
    return path


def _assistant_text(decode, ids, mask) -> list[str]:
    """Decoded runs of masked-in tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(decode(cur)), cur.clear()
    if cur:
        runs.append(decode(cur))
    return runs


def test_chat_template_renders_like_transformers_and_masks_assistant_turns(llama_dir):
    tok = HFTokenizer(llama_dir)
    template, bos, eos = read_chat_template(llama_dir)
    renderer = ChatRenderer(tok, template, bos, eos)
    messages = CONVERSATIONS[0]["messages"]

    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(llama_dir / "tokenizer.json"),
        chat_template=LLAMA3_TEMPLATE,
        bos_token=bos,
        eos_token=eos,
    )
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert renderer.render_text(messages) == expected

    ids, mask = renderer.render(messages)
    assert len(ids) == len(mask)

    def decode(piece):
        return tok._tok.decode(piece, skip_special_tokens=False)

    assert decode(ids) == expected  # byte-level BPE + special tokens: the ids spell the text exactly
    runs = _assistant_text(decode, ids, mask)
    assert runs == [
        "<|start_header_id|>assistant<|end_header_id|>\n\nA mutable sequence.<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\nAn immutable one.<|eot_id|>",
    ]


def test_plain_template_and_mask():
    tok = ByteTokenizer()
    renderer = ChatRenderer(tok)
    messages = load_conversations_from(CONVERSATIONS[1])
    ids, mask = renderer.render(messages)
    assert bytes(ids[:-1]).decode() == "<|user|>\nName a module.\n<|assistant|>\nThe os module.\n"
    assert ids[-1] == tok.eod and mask[-1] == 1
    assert _assistant_text(lambda p: bytes(p).decode(), ids[:-1], mask[:-1]) == [
        "<|assistant|>\nThe os module.\n"
    ]


def load_conversations_from(record):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "one.jsonl"
        p.write_text(json.dumps(record) + "\n")
        return load_conversations(p)[0]


def test_samples_pad_truncate_and_labels(data_file, caplog):
    tok = ByteTokenizer()
    src = SFTSource(data_file, tok, seq_length=64, seed=3)
    assert src.truncated == 1  # the five-turn conversation is longer than 65 bytes
    assert "truncated" in caplog.text
    for index in range(4):  # two epochs
        row, mask = src[index], src.loss_mask(index)
        assert row.shape == (65,) and mask.shape == (65,)
    tokens, labels = sft_micro_batch(src, 0, 0, micro_batch_size=2, dp_size=1, dp_rank=0)
    assert tokens.shape == labels.shape == (2, 64)
    for j in range(2):
        keep = src.loss_mask(j)[1:]
        assert torch.equal(labels[j][keep], src[j][1:][keep])
        assert (labels[j][~keep] == IGNORE_INDEX).all()
    short = next(j for j in range(2) if int(src[j].eq(tok.eod).sum()) > 1)  # the padded one
    assert not src.loss_mask(short)[-1]  # padding never trains
    assert src.label_tokens(0, 2) == int((labels != IGNORE_INDEX).sum())


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"messages": [{"role": "user"}]}), "messages[0].content"),
        (json.dumps({"prompt": "p"}), "'response'"),
        (json.dumps({"text": "x"}), "'messages'"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "no assistant turn"),
    ],
)
def test_bad_line_names_file_line_and_field(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(CONVERSATIONS[1]) + "\n\n" + line + "\n")
    with pytest.raises(ValueError) as err:
        load_conversations(path)
    assert f"{path} line 3" in str(err.value) and field in str(err.value)


def test_masked_loss_matches_torch_ignore_index():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 50, generator=g)
    target = torch.randint(0, 50, (2, 8), generator=g)
    target[0, :3] = IGNORE_INDEX
    target[1, 5:] = IGNORE_INDEX
    ref = F.cross_entropy(logits.view(-1, 50), target.view(-1), ignore_index=IGNORE_INDEX)
    per_token = F.cross_entropy(
        logits.view(-1, 50), target.view(-1), reduction="none", ignore_index=IGNORE_INDEX
    )
    assert torch.allclose(per_token.sum() / (target != IGNORE_INDEX).sum(), ref)


def _masked_ce_case() -> dict:
    ps.initialize_model_parallel(tensor=dist.get_world_size())
    tp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    vocab, shape = 64, (4, 6)
    full = torch.randn(*shape, vocab, generator=g) * 3
    target = torch.randint(0, vocab, shape, generator=g)
    target[0, :4] = IGNORE_INDEX
    target[3, 2:] = IGNORE_INDEX
    ref_logits = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), ignore_index=IGNORE_INDEX)
    ref.backward()
    shard = full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    per_token = vocab_parallel_cross_entropy(shard, target)
    loss = per_token.sum() / (target != IGNORE_INDEX).sum()
    loss.backward()
    ps.destroy_model_parallel()
    return {
        "loss_err": float((loss - ref).abs()),
        "grad_err": float((shard.grad - ref_logits.grad.chunk(tp, dim=-1)[rank]).abs().max()),
        "masked_zero": bool((per_token[target == IGNORE_INDEX] == 0).all()),
    }


@pytest.mark.parametrize("ranks", [1, 2])
def test_vocab_parallel_cross_entropy_ignore_index(ranks):
    for result in spawn(_masked_ce_case, ranks):
        assert result["masked_zero"], result
        assert result["loss_err"] < 1e-5, result
        assert result["grad_err"] < 1e-6, result
