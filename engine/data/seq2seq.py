"""Encoder-decoder samples (model.arch t5): `data.source: seq2seq`, input -> target pairs, and
the batch layout every T5 source shares (span_corruption.py builds on it).

A sample is (encoder ids, target ids). Its microbatch, for the seam (SampleBatch.inputs):
`tokens` [b, seq_length] the encoder ids padded with the pad id, `inputs["attention_mask"]`
[b, seq_length] (True on the encoder's tokens), `inputs["decoder_input_ids"]` [b, seq_length]
(the targets shifted right behind the decoder start id, as transformers' `_shift_right`), and
`labels` [b, seq_length] the targets, IGNORE_INDEX on the padding. Both sides are seq_length
long, so microbatches and pipeline hand-offs keep one shape.

The file (data.path, local or s3://) is JSON lines, one pair per line, in any of:
  {"input": "...", "target": "..."}       the pair itself;
  {"prompt": "...", "response": "..."}    the SFT shorthand, prompt -> response;
  {"messages": [{"role", "content"}, ...]} a chat: the last message must be the assistant's and
      is the target; the messages before it are the input, in the plain chat template of
      engine.data.sft (`<|role|>\\ncontent\\n` each).
Each side is tokenised and ends with the tokenizer's end-of-document id (T5's EOS); a side longer
than seq_length is cut to seq_length - 1 tokens before its EOS (counted, logged once). Samples
are addressed by a global index, the pairs reshuffled per epoch with the job's seed (as SFTSource
does), so a run resumes exactly from its consumed-sample count.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.data.sft import IGNORE_INDEX, ChatRenderer, json_lines
from engine.data.sources import SampleBatch, TokenSource

log = logging.getLogger(__name__)

# The seam's keyword inputs of a T5 model (engine/models/t5.py T5_MODEL_INPUTS).
MODEL_INPUTS = ("decoder_input_ids", "attention_mask")


def seq2seq_batch(
    pairs: Sequence[tuple[list[int], list[int]]], seq_length: int, pad_id: int, start_id: int
) -> SampleBatch:
    """(encoder ids, target ids) pairs, each at most seq_length long -> the microbatch."""
    b = len(pairs)
    tokens = torch.full((b, seq_length), pad_id, dtype=torch.long)
    mask = torch.zeros((b, seq_length), dtype=torch.bool)
    decoder = torch.full((b, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_length), IGNORE_INDEX, dtype=torch.long)
    for row, (enc, target) in enumerate(pairs):
        if len(enc) > seq_length or len(target) > seq_length:
            raise ValueError(f"a sample of {len(enc)} -> {len(target)} ids does not fit model.seq_length {seq_length}")
        tokens[row, : len(enc)] = torch.tensor(enc, dtype=torch.long)
        mask[row, : len(enc)] = True
        labels[row, : len(target)] = torch.tensor(target, dtype=torch.long)
        decoder[row, 0] = start_id
        decoder[row, 1 : len(target)] = torch.tensor(target[:-1], dtype=torch.long)
    return SampleBatch(tokens, labels, inputs={"decoder_input_ids": decoder, "attention_mask": mask})


def sample_indices(consumed: int, microbatch: int, micro_batch_size: int, dp_size: int, dp_rank: int) -> range:
    """The global sample indices of one microbatch of this DP rank (Megatron-Core's sampler)."""
    base = consumed + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
    return range(base, base + micro_batch_size)


def load_pairs(path: str | Path) -> list[tuple[str, str]]:
    """Each line of a JSON-lines file as (input text, target text); errors name the line and field."""
    renderer = ChatRenderer(None)  # the plain template: text only, no tokenizer needed
    out: list[tuple[str, str]] = []
    for where, record in json_lines(path, '{"input": ..., "target": ...}'):
        if "input" in record or "target" in record:
            keys = ("input", "target")
        elif "prompt" in record or "response" in record:
            keys = ("prompt", "response")
        elif "messages" in record:
            out.append(_chat_pair(record["messages"], where, renderer))
            continue
        else:
            raise ValueError(
                f'{where}: field \'input\' is missing: give {{"input": ..., "target": ...}} (or "prompt" and '
                '"response", or "messages")'
            )
        for key in keys:
            if not isinstance(record.get(key), str):
                raise ValueError(f"{where}: field '{key}' is missing or not a string")
        out.append((record[keys[0]], record[keys[1]]))
    if not out:
        raise ValueError(f"data.path {path}: no input -> target pairs (the file is empty)")
    return out


def _chat_pair(messages, where: str, renderer: ChatRenderer) -> tuple[str, str]:
    """A chat as (the messages before the last, rendered; the last one's content)."""
    if not isinstance(messages, list) or len(messages) < 2:
        raise ValueError(f"{where}: field 'messages' must list at least two {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: field 'messages[{i}]' needs a string 'role' and 'content'")
    if messages[-1]["role"] != "assistant":
        raise ValueError(
            f"{where}: field 'messages': the last message is the target and must be the assistant's "
            f"(it is {messages[-1]['role']!r})"
        )
    return renderer.render_text(messages[:-1]), messages[-1]["content"]


class Seq2SeqSource(TokenSource):
    """input -> target pairs, one per sample. `pairs`: already loaded (a split of the file)."""

    model_inputs = MODEL_INPUTS

    def __init__(
        self,
        path: str | Path,
        tokenizer,
        seq_length: int,
        seed: int,
        start_id: int = 0,
        pairs: list[tuple[str, str]] | None = None,
    ):
        pairs = load_pairs(path) if pairs is None else pairs
        self.seq_length, self.seed, self.start_id, self.pad_id = seq_length, seed, start_id, start_id
        eos, cut = tokenizer.eod, 0
        self.samples: list[tuple[list[int], list[int]]] = []
        for source, target in pairs:
            enc, dec = tokenizer.encode(source), tokenizer.encode(target)
            cut += len(enc) >= seq_length or len(dec) >= seq_length
            self.samples.append((enc[: seq_length - 1] + [eos], dec[: seq_length - 1] + [eos]))
        self.truncated = cut
        if cut:
            log.warning(
                "data.path %s: %d of %d pairs have a side longer than model.seq_length - 1 = %d tokens and were cut",
                path,
                cut,
                len(pairs),
                seq_length - 1,
            )
        self._perm_epoch, self._perm = -1, torch.arange(0)

    def sample(self, index: int) -> tuple[list[int], list[int]]:
        epoch, i = divmod(index, len(self.samples))
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.samples), generator=g), epoch
        return self.samples[int(self._perm[i])]

    def micro_batch(
        self, consumed_samples: int, microbatch: int, micro_batch_size: int, dp_size: int, dp_rank: int
    ) -> SampleBatch:
        where = sample_indices(consumed_samples, microbatch, micro_batch_size, dp_size, dp_rank)
        return seq2seq_batch([self.sample(i) for i in where], self.seq_length, self.pad_id, self.start_id)
