"""Exact packing of fine-tuning samples: several whole conversations per seq_length + 1 row.

Why: chat samples are mostly shorter than the sequence, and padding each to its own row wastes
the padded share of every step's compute. Packing fills rows with whole conversations instead,
and stays exact (the same loss and gradients as one conversation per row) because the model is
told where each one starts: every token carries a segment id (its conversation's number in the
row, 1, 2, ...; 0 for the row's trailing padding) and a position id that restarts at 0 with each
conversation. Attention is then block-diagonal causal (a token sees earlier tokens of its own
conversation only, see engine.transformer.packed_seq) and positions (RoPE, learned embeddings) are
the ones an unpacked row would give. The label of a conversation's last token would be the next
conversation's first token: it is masked, as the first token of a row is never a label.

Packing (once, at start-up): the rendered conversations (cut to seq_length + 1 tokens like
`SFTSource`, so a long one fills a row alone) are taken in an order shuffled with the job's seed
and laid greedily (next fit): a conversation goes into the current row if it fits, otherwise it
starts a new one. The rows are then addressed like `SFTSource`'s samples: by a global index,
reshuffled per epoch with seed + epoch, so `consumed_samples` counts rows and a run resumes
exactly from it on any data-parallel size. Every epoch holds the same rows (the same
conversations side by side); only their order changes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.data.sft import ChatRenderer, SFTSource, sft_micro_batch
from engine.data.sources import SampleBatch

log = logging.getLogger(__name__)


def pack(lengths: list[int], width: int, order: list[int]) -> list[list[int]]:
    """Rows of sample indices, taken in `order` and laid next-fit into rows of `width` tokens."""
    rows: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        if current and used + lengths[i] > width:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        rows.append(current)
    return rows


class PackedSFTSource(SFTSource):
    """Rows of seq_length + 1 tokens holding whole conversations, with a loss mask, segment ids
    and per-conversation position ids. `num_samples` counts rows."""

    def __init__(
        self,
        path: str | Path,
        tokenizer,
        seq_length: int,
        seed: int,
        renderer: ChatRenderer | None = None,
        conversations: list[list[dict[str, str]]] | None = None,
    ):
        samples, width = self._render(path, tokenizer, seq_length, seed, renderer, conversations)
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
        self.rows = pack([len(ids) for ids, _ in samples], width, order)
        n = len(self.rows)
        self.tokens = torch.full((n, width), self.pad, dtype=torch.long)
        self.mask = torch.zeros((n, width), dtype=torch.bool)
        self.segments = torch.zeros((n, width), dtype=torch.int32)
        self.positions = torch.zeros((n, width), dtype=torch.long)
        for r, members in enumerate(self.rows):
            start = 0
            for segment, i in enumerate(members, start=1):
                ids, mask = samples[i]
                end = start + len(ids)
                self.tokens[r, start:end] = torch.tensor(ids, dtype=torch.long)
                self.mask[r, start:end] = torch.tensor(mask, dtype=torch.bool)
                self.mask[r, start] = False  # as a label it would follow the previous conversation
                self.segments[r, start:end] = segment
                self.positions[r, start:end] = torch.arange(len(ids))
                start = end
            self.positions[r, start:] = torch.arange(width - start)  # padding: its own segment 0
        self.num_samples = n
        used = sum(len(ids) for ids, _ in samples)
        log.info(
            "data.packing: %d conversations in %d rows of %d tokens (%.0f%% filled)",
            len(samples),
            n,
            width,
            100.0 * used / (n * width),
        )
        self._perm_epoch, self._perm = -1, torch.arange(0)

    def segment_ids(self, index: int) -> torch.Tensor:
        return self.segments[self._row(index)]

    def position_ids(self, index: int) -> torch.Tensor:
        return self.positions[self._row(index)]

    def micro_batch(
        self, consumed_samples: int, microbatch: int, micro_batch_size: int, dp_size: int, dp_rank: int
    ) -> SampleBatch:
        where = (consumed_samples, microbatch, micro_batch_size, dp_size, dp_rank)
        return SampleBatch(*packed_micro_batch(self, *where))


def packed_micro_batch(
    source: PackedSFTSource,
    consumed_samples: int,
    microbatch: int,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, labels, position_ids, segment_ids), each [micro_batch_size, seq_length], the rows
    taken as `sft_micro_batch` takes samples."""
    tokens, labels = sft_micro_batch(source, consumed_samples, microbatch, micro_batch_size, dp_size, dp_rank)
    base = consumed_samples + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
    positions = torch.stack([source.position_ids(base + j)[:-1] for j in range(micro_batch_size)])
    segments = torch.stack([source.segment_ids(base + j)[:-1] for j in range(micro_batch_size)])
    return tokens, labels, positions, segments
