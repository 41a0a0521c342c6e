"""`data.source: span_corruption`: T5's pretraining objective over raw text (model.arch t5).

Each sample is a window of `raw_length` tokens of the text (the text and split sources,
engine/data/builder.py), corrupted as T5 does it (t5.data.preprocessors.span_corruption, with
its defaults): 15 % of the tokens (`noise_density`, rounded, at least one) form
round(noise / 3) spans (`mean_noise_span_length` 3), the span lengths and the kept stretches
between them drawn as a uniformly random segmentation (`random_spans_noise_mask`), the window
starting with kept tokens. The encoder reads the kept tokens with each span replaced by one
sentinel, then EOS; the target is each span's sentinel followed by its tokens, then EOS.

Sentinels: a tokenizer that has T5's `<extra_id_k>` tokens (each encodes to one id: Hugging
Face's T5 tokenizers) gives its own; otherwise they are the highest ids of the model's
vocabulary counting down (span k is vocab_size - 1 - k, where HF places `<extra_id_k>`), which
must not be ids the tokenizer itself gives: the model's vocabulary (model.vocab_size) must then
reach beyond the tokenizer's by the most spans a sample has (checked at start, with the size).

`raw_length` is the longest window whose corrupted input (kept + spans + EOS) fits
model.seq_length (T5's compute_input_and_target_lengths); the targets (noise + spans + EOS) are
shorter. The draw of sample i is seeded by (seed, i) alone, so the samples depend on the consumed
sample count only, whatever the data-parallel layout: a resume is exact.

EOS is the tokenizer's end-of-document id; the pad and decoder start id model.t5's
decoder_start_token_id (T5: 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.data.seq2seq import MODEL_INPUTS, sample_indices, seq2seq_batch
from engine.data.sources import SampleBatch, TokenSource

NOISE_DENSITY = 0.15
MEAN_NOISE_SPAN_LENGTH = 3.0


@dataclass(frozen=True)
class SpanCounts:
    """How a window of `length` tokens is corrupted: noise tokens and spans."""

    length: int
    noise: int
    spans: int

    @classmethod
    def of(cls, length: int, density: float = NOISE_DENSITY, mean_span: float = MEAN_NOISE_SPAN_LENGTH) -> SpanCounts:
        noise = min(max(round(length * density), 1), length - 1)
        return cls(length, noise, max(round(noise / mean_span), 1))

    @property
    def input_length(self) -> int:
        """Kept tokens, one sentinel per span, EOS."""
        return self.length - self.noise + self.spans + 1

    @property
    def target_length(self) -> int:
        """Each span's sentinel and tokens, EOS."""
        return self.noise + self.spans + 1


def raw_length_for(seq_length: int) -> int:
    """The longest window whose corrupted input fits `seq_length` ids (at least 2 tokens)."""
    if seq_length < 4:
        raise ValueError(f"data.source span_corruption needs model.seq_length >= 4, got {seq_length}")
    length = 2
    while SpanCounts.of(length + 1).input_length <= seq_length:
        length += 1
    return length


def _segmentation(items: int, segments: int, g: torch.Generator) -> torch.Tensor:
    """`items` split into `segments` non-empty runs, uniformly at random: their lengths."""
    first = torch.zeros(items, dtype=torch.bool)
    first[1:][torch.randperm(items - 1, generator=g)[: segments - 1]] = True
    first[0] = True
    return torch.bincount(torch.cumsum(first.long(), 0) - 1, minlength=segments)


def noise_mask(length: int, g: torch.Generator) -> torch.Tensor:
    """[length] bool, True on the noise tokens (T5's random_spans_noise_mask)."""
    c = SpanCounts.of(length)
    noise = _segmentation(c.noise, c.spans, g)
    kept = _segmentation(length - c.noise, c.spans, g)
    runs = torch.stack([kept, noise], dim=1).reshape(-1)  # kept, noise, kept, noise, ...
    is_noise = torch.tensor([False, True]).repeat(c.spans)
    return torch.repeat_interleave(is_noise, runs)


def corrupt(ids: torch.Tensor, mask: torch.Tensor, sentinels: list[int], eos: int) -> tuple[list[int], list[int]]:
    """(encoder ids, target ids) of a window `ids` with noise `mask`; span k's sentinel is
    sentinels[k]."""
    inputs: list[int] = []
    targets: list[int] = []
    span = -1
    previous = False
    for token, noisy in zip(ids.tolist(), mask.tolist(), strict=True):
        if noisy:
            if not previous:
                span += 1
                inputs.append(sentinels[span])
                targets.append(sentinels[span])
            targets.append(token)
        else:
            inputs.append(token)
        previous = noisy
    return inputs + [eos], targets + [eos]


class SpanCorruptionSource(TokenSource):
    """T5 span-corruption samples over `windows` (a source of raw_length-token windows, indexed
    like every source by global sample index)."""

    model_inputs = MODEL_INPUTS

    def __init__(self, windows, seq_length: int, seed: int, sentinels: list[int], eos: int, start_id: int = 0):
        self.windows, self.seq_length, self.seed = windows, seq_length, seed
        self.sentinels, self.eos, self.start_id = sentinels, eos, start_id
        self.raw_length = raw_length_for(seq_length)

    def sample(self, index: int) -> tuple[list[int], list[int]]:
        ids = self.windows[index][: self.raw_length]
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + index * 7919 + 17) % (2**63))
        return corrupt(ids, noise_mask(len(ids), g), self.sentinels, self.eos)

    def micro_batch(
        self, consumed_samples: int, microbatch: int, micro_batch_size: int, dp_size: int, dp_rank: int
    ) -> SampleBatch:
        where = sample_indices(consumed_samples, microbatch, micro_batch_size, dp_size, dp_rank)
        return seq2seq_batch([self.sample(i) for i in where], self.seq_length, self.start_id, self.start_id)


def sentinel_ids(tokenizer, vocab_size: int, seq_length: int) -> list[int]:
    """Span k's sentinel id, for as many spans as a sample has: the tokenizer's `<extra_id_k>`
    when each is one token of it, else vocab_size - 1 - k, above the tokenizer's own ids."""
    spans = SpanCounts.of(raw_length_for(seq_length)).spans
    named = [tokenizer.encode(f"<extra_id_{k}>") for k in range(spans)]
    if all(len(ids) == 1 for ids in named):
        return [ids[0] for ids in named]
    tokenizer_vocab = tokenizer.vocab_size
    if vocab_size - spans < tokenizer_vocab:
        raise ValueError(
            f"data.source span_corruption: a sample has up to {spans} spans, whose sentinels are the top ids of the "
            f"model's vocabulary ({vocab_size}), but the tokenizer uses ids up to {tokenizer_vocab - 1}: set "
            f"model.vocab_size to at least {tokenizer_vocab + spans} (or use a tokenizer with T5's <extra_id_N> tokens)"
        )
    return [vocab_size - 1 - k for k in range(spans)]


def t5_datasets(
    spec,
    tokenizer,
    seq_length: int,
    seed: int,
    counts: Sequence[int | None],
    vocab_size: int | None,
    build: Callable,
) -> list:
    """(train, valid, test) sources of a T5 job: span corruption over the text source's windows
    (data.path and data.split as for data.source text; `build` is builder.build_datasets), or
    seq2seq pairs split in file order by data.split. `vocab_size`: the model's vocabulary
    (sentinels); `spec`: the job, or its data section (then the decoder start id is T5's 0)."""
    from engine.data.blending import split_doc_ranges
    from engine.data.seq2seq import Seq2SeqSource, load_pairs

    data = getattr(spec, "data", spec)
    t5 = getattr(getattr(spec, "model", None), "t5", None)
    start = t5.decoder_start_token_id if t5 is not None else 0
    if data.source == "seq2seq":
        pairs = load_pairs(data.path)
        out = []
        for i, (a, b) in enumerate(split_doc_ranges(len(pairs), data.split or [1.0])):
            if a == b and i == 0:
                raise ValueError(f"data.split leaves no training pairs in {data.path} ({len(pairs)} lines)")
            out.append(Seq2SeqSource(data.path, tokenizer, seq_length, seed, start, pairs[a:b]) if a < b else None)
        return (out + [None] * 3)[:3]
    sentinels = sentinel_ids(tokenizer, vocab_size or tokenizer.vocab_size, seq_length)
    windows = build(data.model_copy(update={"source": "text"}), tokenizer, raw_length_for(seq_length) - 1, seed, counts)
    return [
        None if w is None else SpanCorruptionSource(w, seq_length, seed, sentinels, tokenizer.eod, start)
        for w in (windows.train, windows.valid, windows.test)
    ]
