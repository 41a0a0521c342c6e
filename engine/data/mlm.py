"""Masked-LM samples for BERT (`data.source: mlm`), over the text and indexed sources' windows.

A sample is `[CLS] w_1 ... w_{s-2} [SEP]`, where w is a window of s - 2 tokens of the underlying
source (TextSource, or GPTDataset over an indexed dataset or a text file's split: windows run
across documents, their EOD ids becoming [SEP], as BERT separates segments). Then, as BERT and
transformers' DataCollatorForLanguageModeling do: every token but [CLS]/[SEP]/[PAD] is selected
with probability `mask_prob` (independently; with `whole_word`, every word is, and its tokens
follow it); a selected token becomes [MASK] with probability 0.8, a random token of the
tokenizer's vocabulary with 0.1, and stays itself with 0.1. Its label is the original token;
labels elsewhere are IGNORE_INDEX, so the loss is the mean over the selected tokens.

Deterministic by consumed samples: sample i's draws come from a generator seeded by (seed, i)
and its window is the underlying source's sample i, so a resume on any data-parallel layout
reads the same samples.

The special ids: `data.mlm.{cls,sep,pad,mask}_id`, else the tokenizer's own [CLS], [SEP], [PAD],
[MASK] tokens (a BERT WordPiece tokenizer.json has them); a tokenizer without them (the byte
tokenizer) needs the ids set, e.g. to reserved ids past its vocabulary (with model.vocab_size
large enough). Every id must lie inside the model's vocabulary.

Sentence pairs (`next_sentence`, for the model's binary head): `[CLS] A [SEP] B [SEP]`, A and B
the two parts of a window of s - 3 tokens cut at a random token; with probability 0.5 B is
replaced by as many tokens from the start of a random window of the same epoch (label 1: "random next",
transformers' convention; 0: B follows A). The cut, the coin and the other window come from a
second generator seeded by (seed, i).

The model's further inputs (SampleBatch.inputs): `attention_mask` (1 on real tokens; windows are
full, so all 1 here; the model honours 0s, e.g. from a padded source), `token_type_ids` (0: one
segment; with pairs 0 for [CLS] A [SEP], 1 for B [SEP]) and, with pairs, `next_sentence_label` [b].
"""

from __future__ import annotations

import torch

from engine.data.sft import IGNORE_INDEX
from engine.data.sources import SampleBatch, TokenSource
from engine.jobspec.bert import MLMSpec

SPECIAL = {"cls_id": "[CLS]", "sep_id": "[SEP]", "pad_id": "[PAD]", "mask_id": "[MASK]"}
MODEL_INPUTS = ("attention_mask", "token_type_ids")


def _vocab_lookups(tokenizer):
    """(token -> id or None, id -> token) of a tokenizer with named tokens (hf:, sentencepiece:);
    (None, None) for the byte tokenizer, which has none."""
    if not hasattr(tokenizer, "token_to_id"):
        return None, None
    return tokenizer.token_to_id, tokenizer.id_to_token


def special_ids(spec: MLMSpec, tokenizer, model_vocab: int) -> dict[str, int]:
    """{cls_id, sep_id, pad_id, mask_id}: the spec's, else the tokenizer's tokens; checked."""
    lookup, _ = _vocab_lookups(tokenizer)
    out = {}
    for field, token in SPECIAL.items():
        value = getattr(spec, field)
        if value is None and lookup is not None:
            value = lookup(token)
        if value is None:
            raise ValueError(
                f"data.mlm.{field}: the tokenizer ({getattr(tokenizer, 'spec', 'byte')}) has no {token} token: set "
                f"data.mlm.{field} (e.g. a reserved id past the tokenizer's {tokenizer.vocab_size} ids, with "
                "model.vocab_size covering it)"
            )
        if not 0 <= value < model_vocab:
            raise ValueError(
                f"data.mlm.{field} ({value}) is outside the model's vocabulary of {model_vocab} ids: raise "
                "model.vocab_size or pick another id"
            )
        out[field] = int(value)
    if len(set(out.values())) != len(out):
        raise ValueError(f"data.mlm: the special token ids must differ, got {out}")
    return out


def word_starts_table(tokenizer, vocab: int) -> torch.Tensor | None:
    """[vocab] bool: whether a token can only continue a word (WordPiece '##x', a SentencePiece
    piece without the '\u2581' word mark); None for a byte tokenizer (words end at whitespace)."""
    _, to_token = _vocab_lookups(tokenizer)
    if to_token is None:
        return None
    pieces = [to_token(i) or "" for i in range(vocab)]
    if any(p.startswith("##") for p in pieces):
        return torch.tensor([p.startswith("##") for p in pieces])
    if any(p.startswith("\u2581") for p in pieces):
        return torch.tensor([not p.startswith("\u2581") and not p.startswith("<") for p in pieces])
    return None


class MLMSource(TokenSource):
    """Masked-LM samples over `windows` (a source of (seq_length - 2) + 1 ids per index: TextSource
    or GPTDataset built with seq_length - 3); see the module docstring."""

    def __init__(self, windows, tokenizer, spec: MLMSpec, seq_length: int, seed: int, model_vocab: int):
        self.windows, self.spec, self.seq_length, self.seed = windows, spec, seq_length, seed
        self.ids = special_ids(spec, tokenizer, model_vocab)
        self.eod = tokenizer.eod
        self.random_vocab = tokenizer.vocab_size  # random replacements: the tokenizer's own tokens
        self.continues = word_starts_table(tokenizer, tokenizer.vocab_size) if spec.whole_word else None
        self.model_inputs = MODEL_INPUTS + (("next_sentence_label",) if spec.next_sentence else ())
        # Windows per epoch: a random second segment is drawn from the sample's own epoch, whose
        # index the underlying source already holds (another epoch's would be built for it).
        self.per_epoch = len(windows) if hasattr(windows, "__len__") else windows.num_windows

    def _window(self, index: int, length: int) -> torch.Tensor:
        w = self.windows[index][:length].clone()
        w[w == self.eod] = self.ids["sep_id"]
        return w

    def pair(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Sample `index` before masking: (tokens, token types, next-sentence label or None), the
        tokens [CLS] window [SEP] or, with pairs, [CLS] A [SEP] B [SEP]; EODs as [SEP]."""
        cls, sep = (torch.tensor([self.ids[k]]) for k in ("cls_id", "sep_id"))
        s = self.seq_length
        if not self.spec.next_sentence:
            tokens = torch.cat([cls, self._window(index, s - 2), sep])
            return tokens, torch.zeros_like(tokens), None
        g = torch.Generator().manual_seed(((self.seed + 1) * 1_000_033 + index) % (2**63))
        w = self._window(index, s - 3)
        cut = int(torch.randint(1, len(w), (1,), generator=g))
        random_next = bool(torch.rand(1, generator=g) < 0.5)
        b = w[cut:]
        if random_next:
            epoch_start = index - index % self.per_epoch
            other = epoch_start + int(torch.randint(0, self.per_epoch, (1,), generator=g))
            b = self._window(other, len(b))
        tokens = torch.cat([cls, w[:cut], sep, b, sep])
        types = torch.zeros_like(tokens)
        types[cut + 2 :] = 1
        return tokens, types, int(random_next)

    def tokens(self, index: int) -> torch.Tensor:
        """Sample `index`'s tokens before masking, [seq_length]."""
        return self.pair(index)[0]

    def _word_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """[s] long: the word each token belongs to (whole-word masking)."""
        if self.continues is not None:
            known = tokens < len(self.continues)
            cont = torch.zeros_like(tokens, dtype=torch.bool)
            cont[known] = self.continues[tokens[known]]
        else:  # bytes: a token continues a word when it and the one before are not whitespace
            space = torch.isin(tokens, torch.tensor([9, 10, 11, 12, 13, 32]))
            cont = ~space & torch.cat([torch.tensor([False]), ~space[:-1]])
        special = torch.isin(tokens, torch.tensor(list(self.ids.values())))
        cont &= ~special & torch.cat([torch.tensor([False]), ~special[:-1]])
        return torch.cumsum(~cont, 0) - 1

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(masked tokens, labels, attention mask), each [seq_length], of sample `index`."""
        return self._sample(index)[:3]

    def _sample(self, index: int) -> tuple:
        """sample()'s three tensors, then the token types and the next-sentence label."""
        tokens, types, next_label = self.pair(index)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (2**63))
        s = tokens.shape[0]
        if self.spec.whole_word:
            words = self._word_ids(tokens)
            chosen = (torch.rand(int(words[-1]) + 1, generator=g) < self.spec.mask_prob)[words]
        else:
            chosen = torch.rand(s, generator=g) < self.spec.mask_prob
        special = torch.isin(tokens, torch.tensor([self.ids[k] for k in ("cls_id", "sep_id", "pad_id")]))
        chosen &= ~special
        how = torch.rand(s, generator=g)  # < 0.8: [MASK]; < 0.9: a random token; else kept
        random_tokens = torch.randint(0, self.random_vocab, (s,), generator=g)
        labels = tokens.masked_fill(~chosen, IGNORE_INDEX)
        masked = tokens.clone()
        masked[chosen & (how < 0.8)] = self.ids["mask_id"]
        swap = chosen & (how >= 0.8) & (how < 0.9)
        masked[swap] = random_tokens[swap]
        return masked, labels, (tokens != self.ids["pad_id"]).long(), types, next_label

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.sample(index)[0]

    def micro_batch(
        self, consumed_samples: int, microbatch: int, micro_batch_size: int, dp_size: int, dp_rank: int
    ) -> SampleBatch:
        """Samples taken by global index as every source does (Megatron-Core's sampler)."""
        base = consumed_samples + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
        rows = [self._sample(base + j) for j in range(micro_batch_size)]
        tokens, labels, mask, types = (torch.stack([r[k] for r in rows]) for k in range(4))
        inputs = {"attention_mask": mask, "token_type_ids": types}
        if self.spec.next_sentence:
            inputs["next_sentence_label"] = torch.tensor([r[4] for r in rows], dtype=torch.long)
        return SampleBatch(tokens, labels, inputs=inputs)


def mlm_sources(windows, spec: MLMSpec, tokenizer, seq_length: int, seed: int, model_vocab: int | None) -> list:
    """Train / valid / test MLMSources over the underlying splits (`windows`: a builder.Datasets)."""
    vocab = model_vocab or tokenizer.vocab_size
    return [
        None if w is None else MLMSource(w, tokenizer, spec, seq_length, seed, vocab)
        for w in (windows.train, windows.valid, windows.test)
    ]
