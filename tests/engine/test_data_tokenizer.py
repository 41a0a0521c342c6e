"""Tokenizers: byte, Hugging Face tokenizers and SentencePiece, trained here from the shipped corpus."""

from __future__ import annotations

import pytest

from engine.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
    parse_tokenizer_spec,
)
from tests.engine.data_helpers import CORPUS, train_hf_bpe, train_hf_wordlevel, train_sentencepiece

SAMPLES = [
    "Return the absolute value of x.",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Unicode: déjà vu, 東京, emoji 🐍 and a zero-width\u200bspace",
    "",
]


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
    return train_hf_bpe(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("sp"))


def test_spec_forms():
    assert parse_tokenizer_spec("byte") == ("byte", None)
    assert parse_tokenizer_spec("hf:/a/tokenizer.json") == ("hf", "/a/tokenizer.json")
    assert parse_tokenizer_spec("sentencepiece:m.model") == ("sentencepiece", "m.model")
    for bad in ["gpt2", "hf:", "sentencepiece", "spm:x.model", "HF:x", ""]:
        with pytest.raises(ValueError, match=r"^data\.tokenizer .* is not supported: use 'byte', 'hf:PATH'"):
            build_tokenizer(bad)


def test_byte_tokenizer_round_trips_and_ends_documents_with_256():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eod) == (257, 256)
    for text in SAMPLES:
        assert tok.decode(tok.encode(text) + [tok.eod]) == text
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]


def test_hf_tokenizer_round_trips_and_finds_its_eod(hf_path):
    tok = build_tokenizer(f"hf:{hf_path}")
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 600
    assert tok.eod == tok._tok.token_to_id("<|endoftext|>")
    text = CORPUS.read_text()[:5000]
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) / 1.5  # BPE merges: fewer ids than bytes
    assert all(0 <= i < tok.vocab_size for i in ids) and tok.eod not in ids
    assert tok.decode(ids) == text
    for t in SAMPLES:
        assert tok.decode(tok.encode(t)) == t
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]
    # A folder holding tokenizer.json is accepted too.
    assert build_tokenizer(f"hf:{hf_path.parent}").encode(text) == ids


def test_hf_eod_from_other_special_tokens(tmp_path):
    tok = build_tokenizer(f"hf:{train_hf_wordlevel(tmp_path / 'eos', ['<pad>', '</s>'])}")
    assert tok.eod == tok._tok.token_to_id("</s>") == 2
    assert tok.decode(tok.encode("Return the value")) == "Return the value"


def test_hf_without_an_eod_token_is_refused_with_the_fix(tmp_path):
    path = train_hf_wordlevel(tmp_path / "none", ["<pad>"])
    with pytest.raises(
        ValueError, match=r"data\.tokenizer .* has no end-of-document token.*<\|endoftext\|>.*special"
    ):
        build_tokenizer(f"hf:{path}")


def test_sentencepiece_round_trips_and_uses_its_eos(sp_path):
    tok = build_tokenizer(f"sentencepiece:{sp_path}")
    assert isinstance(tok, SentencePieceTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 400
    assert tok.eod == tok._sp.eos_id() == tok._sp.piece_to_id("</s>")
    text = CORPUS.read_text()[:5000]
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids) and tok.eod not in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eod]) == text  # the control token decodes to nothing
    for t in SAMPLES:
        assert tok.decode(tok.encode(t)) == t
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]


def test_sentencepiece_without_eos_falls_back_on_an_eod_piece_or_refuses(tmp_path):
    path = train_sentencepiece(tmp_path, "noeos", eos_id=-1, user_defined_symbols=["<|endoftext|>"])
    tok = build_tokenizer(f"sentencepiece:{path}")
    assert tok.eod == tok._sp.piece_to_id("<|endoftext|>") and tok.eod != tok._sp.unk_id()
    path = train_sentencepiece(tmp_path, "bare", eos_id=-1)
    with pytest.raises(ValueError, match=r"no end-of-document token.*trained with eos_id=-1"):
        build_tokenizer(f"sentencepiece:{path}")


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_a_missing_tokenizer_file_names_the_file_and_the_field(tmp_path, kind):
    missing = tmp_path / "nowhere" / ("tokenizer.json" if kind == "hf" else "m.model")
    with pytest.raises(FileNotFoundError) as err:
        build_tokenizer(f"{kind}:{missing}")
    assert "data.tokenizer" in str(err.value) and str(missing) in str(err.value)
    assert "nothing is downloaded" in str(err.value)


def test_a_folder_without_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file .*tokenizer\.json"):
        build_tokenizer(f"hf:{tmp_path}")


def test_a_file_of_the_wrong_kind_is_a_clear_error(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_text("not a tokenizer")
    with pytest.raises(ValueError, match="is not a tokenizer.json"):
        build_tokenizer(f"hf:{junk}")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        build_tokenizer(f"sentencepiece:{junk}")
