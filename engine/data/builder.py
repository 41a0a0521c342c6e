"""The job's `data` section -> the train, valid and test sample sources of a run.

Every source maps a global sample index to a LongTensor of seq_length + 1 token ids, for any
index >= 0 (epochs wrap), so `micro_batch` can take samples by global index from consumed_samples
and a resume is exact on any data-parallel size. What each `data.source` gives:

  synthetic  train: seeded random tokens; no valid/test.
  text       no data.split: train is the whole file through TextSource (tokenised at start);
             with data.split: the file's paragraphs are split by documents and sampled by
             GPTDataset in memory (nothing cached on disk).
  indexed    GPTDataset over the documents of data.path's split; the sample indexes are cached.
  blend      per split, a BlendedDataset of each data.blend prefix's part of that split.
  mlm        masked-LM samples (engine.data.mlm) over the windows text or indexed (data.mlm.corpus)
             would give, of seq_length - 2 ids: [CLS] window [SEP].
  sft        chat conversations (data.path, JSON lines) rendered with the tokenizer's chat
             template, one per sample (SFTSource) or packed several per row (PackedSFTSource,
             data.packing); data.split splits the conversations in file order.
  span_corruption, seq2seq  model.arch t5's encoder-decoder samples (engine/data/span_corruption.py,
             engine/data/seq2seq.py): T5's sentinel spans over the text source's windows, or
             input -> target pairs from JSON lines.

A split with no documents (a share of 0, or one that rounds to nothing) is None. Without
data.split every document trains and valid/test are None.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine.data.blending import BlendedDataset, split_doc_ranges
from engine.data.gpt_dataset import GPTDataset
from engine.data.indexed_dataset import IndexedDataset, dtype_for_vocab
from engine.data.packing import PackedSFTSource
from engine.data.preprocess import DocumentReader
from engine.data.sft import ChatRenderer, SFTSource, load_conversations, read_chat_template
from engine.data.sources import SHIPPED_CORPUS, SampleBatch, SyntheticSource, TextSource
from engine.data.span_corruption import t5_datasets
from engine.data.tokenizer import Tokenizer
from engine.jobspec import DataSpec, JobSpec
from engine.jobspec.data import parse_tokenizer_spec

SPLITS = ("train", "valid", "test")


class Source(Protocol):
    def __getitem__(self, index: int) -> torch.Tensor: ...

    def micro_batch(
        self, consumed_samples: int, microbatch: int, micro_batch_size: int, dp_size: int, dp_rank: int
    ) -> SampleBatch: ...


@dataclass
class Datasets:
    train: Source
    valid: Source | None = None
    test: Source | None = None


def build_datasets(
    spec: DataSpec | JobSpec,
    tokenizer: Tokenizer,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int | None] | None = None,
    synthetic_vocab_size: int | None = None,
) -> Datasets:
    """The sources of a run. `spec` is the job or its data section.

    num_samples: (train, valid, test) samples the run will read; it sizes the cached sample indexes
    (how many epochs are built ahead) and the blends' length, never which sample an index gives.
    synthetic_vocab_size: the range of synthetic ids (the model's vocabulary, without padding; also where
    span_corruption's sentinels count down from); default the tokenizer's.
    """
    data: DataSpec = spec.data if isinstance(spec, JobSpec) else spec
    counts = list(num_samples) if num_samples is not None else [None, None, None]
    if data.source == "synthetic":
        return Datasets(SyntheticSource(synthetic_vocab_size or tokenizer.vocab_size, seq_length, seed))
    if data.source == "sft":
        return Datasets(*_sft(data, tokenizer, seq_length, seed))
    if data.source == "mlm":
        from engine.data.mlm import mlm_sources

        windows = build_datasets(_mlm_windows(data), tokenizer, seq_length - 3, seed, num_samples)
        return Datasets(*mlm_sources(windows, data.mlm, tokenizer, seq_length, seed, synthetic_vocab_size))
    if data.source in ("span_corruption", "seq2seq"):  # model.arch t5's samples
        return Datasets(*t5_datasets(spec, tokenizer, seq_length, seed, counts, synthetic_vocab_size, build_datasets))
    if data.source == "text" and data.split is None:
        return Datasets(TextSource(data.path, tokenizer, seq_length, seed))
    ratios = data.split or [1.0, 0.0, 0.0]
    cache = Path(data.cache_dir) if data.cache_dir else None
    if data.source == "text":
        parts = _split(_text_dataset(data.path, tokenizer), ratios, seq_length, seed, counts, None, data.path)
    elif data.source == "indexed":
        parts = _split(
            _open(data.path, tokenizer, "data.path"), ratios, seq_length, seed, counts, cache, data.path
        )
    else:
        parts = _blend(data.blend, tokenizer, ratios, seq_length, seed, counts, cache)
    return Datasets(*parts)


def _mlm_windows(data: DataSpec) -> DataSpec:
    """data.source mlm: the text or indexed source whose windows (of seq_length - 2 ids) it masks."""
    return data.model_copy(update={"source": data.mlm.corpus, "mlm": None})


def _sft(data: DataSpec, tokenizer: Tokenizer, seq_length: int, seed: int) -> list[SFTSource | None]:
    """Train / valid / test sources of chat conversations, split in file order by data.split."""
    _, tokenizer_path = parse_tokenizer_spec(data.tokenizer)
    template, bos, eos = read_chat_template(tokenizer_path) if tokenizer_path else (None, "", "")
    renderer = ChatRenderer(tokenizer, template, bos, eos)
    conversations = load_conversations(data.path)
    make = PackedSFTSource if data.packing else SFTSource
    out: list[SFTSource | None] = []
    for name, (start, end) in zip(
        SPLITS, split_doc_ranges(len(conversations), data.split or [1.0]), strict=False
    ):
        if start == end:
            if name == "train":
                raise ValueError(
                    f"data.split leaves no training conversations in {data.path} ({len(conversations)} lines)"
                )
            out.append(None)
            continue
        out.append(make(data.path, tokenizer, seq_length, seed, renderer, conversations[start:end]))
    return out + [None] * (3 - len(out))


def _open(prefix: str, tokenizer: Tokenizer, field: str) -> IndexedDataset:
    try:
        indexed = IndexedDataset(prefix)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{field}: {err}") from None
    if indexed.dtype != dtype_for_vocab(tokenizer.vocab_size):
        raise ValueError(
            f"{field}: {prefix} holds {indexed.dtype} ids but data.tokenizer has {tokenizer.vocab_size} ids (stored as "
            f"{dtype_for_vocab(tokenizer.vocab_size)}): preprocess it with the job's tokenizer"
        )
    return indexed


def _text_dataset(path: str | None, tokenizer: Tokenizer) -> IndexedDataset:
    """A text file's paragraphs as documents in memory, cut exactly as `elastron preprocess` cuts them."""
    path = Path(path) if path else SHIPPED_CORPUS
    if not path.is_file():
        raise FileNotFoundError(f"data.path: no such file {path}")
    docs = [ids + [tokenizer.eod] for ids in tokenizer.encode_batch(list(DocumentReader([path])))]
    return IndexedDataset.from_documents(docs, tokenizer.vocab_size)


def _split(
    indexed: IndexedDataset,
    ratios: Sequence[float],
    seq_length: int,
    seed: int,
    counts: Sequence[int | None],
    cache: Path | None,
    where: str | None,
) -> list[GPTDataset | None]:
    out: list[GPTDataset | None] = []
    for name, (start, end), count in zip(SPLITS, split_doc_ranges(len(indexed), ratios), counts, strict=True):
        if start == end:
            if name == "train":
                raise ValueError(
                    f"data.split leaves no training documents in {where} ({len(indexed)} documents)"
                )
            out.append(None)
            continue
        out.append(
            GPTDataset(
                indexed,
                seq_length,
                seed,
                doc_range=(start, end),
                num_samples=count,
                split=name,
                cache_dir=cache,
            )
        )
    return out


def _blend(
    blend: Sequence[tuple[float, str]],
    tokenizer: Tokenizer,
    ratios: Sequence[float],
    seq_length: int,
    seed: int,
    counts: Sequence[int | None],
    cache: Path | None,
) -> list[BlendedDataset | None]:
    total = sum(w for w, _ in blend)
    per_prefix = []
    for weight, prefix in blend:
        # Each part is asked for its share of the blend (+1: the greedy rounds either way).
        share = [None if n is None else math.ceil(weight / total * n) + 1 for n in counts]
        per_prefix.append(
            _split(_open(prefix, tokenizer, "data.blend"), ratios, seq_length, seed, share, cache, prefix)
        )
    out: list[BlendedDataset | None] = []
    for i, count in enumerate(counts):
        members = [
            (w, parts[i]) for (w, _), parts in zip(blend, per_prefix, strict=True) if parts[i] is not None
        ]
        out.append(
            BlendedDataset([d for _, d in members], [w for w, _ in members], count) if members else None
        )
    return out
