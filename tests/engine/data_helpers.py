"""Small real tokenizers for the data tests, trained from the shipped corpus at test time (no downloads)."""

from __future__ import annotations

from pathlib import Path

from engine.data.sources import SHIPPED_CORPUS

CORPUS = SHIPPED_CORPUS


def train_hf_bpe(folder: Path, vocab_size: int = 600, eod: str | None = "<|endoftext|>") -> Path:
    """A byte-level BPE tokenizer.json (GPT-2 style): every string round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eod] if eod else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def train_hf_wordlevel(folder: Path, special_tokens: list[str]) -> Path:
    """A whitespace word-level tokenizer.json with the given special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=2000, special_tokens=["[UNK]", *special_tokens], show_progress=False
    )
    tok.train([str(CORPUS)], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def train_sentencepiece(folder: Path, name: str = "sp", vocab_size: int = 400, **options) -> Path:
    """A SentencePiece BPE model with byte fallback and no normalisation: exact round trips."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=str(CORPUS),
        model_prefix=str(folder / name),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=0.995,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
        **options,
    )
    return folder / f"{name}.model"
