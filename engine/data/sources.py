"""Token sources: a sample is seq_length + 1 token ids (inputs and next-token labels).

Samples are addressed by a global index so a run is reproducible and resumable from the number
of consumed samples alone, whatever the data-parallel layout. `TextSource` tokenises one UTF-8
file at start-up and cuts it into fixed windows, reshuffled per epoch with the job's seed;
`SyntheticSource` draws seeded random tokens (benchmarks: no I/O, no tokenisation).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from engine.data.tokenizer import ByteTokenizer

SHIPPED_CORPUS = Path(__file__).parent / "corpus" / "python_stdlib_docs.txt"


class SampleBatch(NamedTuple):
    """One microbatch as a source reads it: inputs and next-token labels, each [micro_batch_size,
    seq]; a packed source adds each token's position within its sample and its sample's id.
    `inputs`: the model's further keyword inputs, each with the microbatch's rows as dim 0 (an
    encoder's padding mask and token types, an encoder-decoder's decoder input ids); the source
    names them in `model_inputs`."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    inputs: dict[str, torch.Tensor] | None = None


class TokenSource:
    """A source whose samples are rows of seq_length + 1 token ids, every label trained. The
    Trainer asks each source for its microbatches (`micro_batch`), so a source with labels to mask
    or rows to pack says so itself (engine.data.sft, engine.data.packing).

    `model_inputs`: the names of the keyword inputs its batches carry beyond the tokens (see
    SampleBatch.inputs); every pipeline stage reads those, since any stage's layers may need them."""

    model_inputs: tuple[str, ...] = ()

    def __getitem__(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def micro_batch(
        self, consumed_samples: int, microbatch: int, micro_batch_size: int, dp_size: int, dp_rank: int
    ) -> SampleBatch:
        return SampleBatch(*micro_batch(self, consumed_samples, microbatch, micro_batch_size, dp_size, dp_rank))


class TextSource(TokenSource):
    def __init__(self, path: str | Path | None, tokenizer: ByteTokenizer, seq_length: int, seed: int):
        path = Path(path) if path else SHIPPED_CORPUS
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"data.path: no such file {path}") from None
        docs = [d for d in text.split("\n\n") if d.strip()]
        ids: list[int] = []
        for d in docs:
            ids.extend(tokenizer.encode(d))
            ids.append(tokenizer.eod)
        self.tokens = torch.tensor(ids, dtype=torch.long)
        self.seq_length, self.seed = seq_length, seed
        self.num_windows = (len(self.tokens) - 1) // seq_length
        if self.num_windows < 1:
            raise ValueError(
                f"data.path {path} has {len(self.tokens)} tokens: fewer than model.seq_length + 1"
            )
        self._perm_epoch, self._perm = -1, torch.arange(0)

    def __getitem__(self, index: int) -> torch.Tensor:
        epoch, i = divmod(index, self.num_windows)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_windows, generator=g), epoch
        start = int(self._perm[i]) * self.seq_length
        return self.tokens[start : start + self.seq_length + 1]


class SyntheticSource(TokenSource):
    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __getitem__(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)


def micro_batch(
    source, consumed_samples: int, microbatch: int, micro_batch_size: int, dp_size: int, dp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), each [micro_batch_size, seq], for one microbatch of this DP rank.

    The global batch is the samples [consumed, consumed + global_batch), cut in slices of
    micro_batch_size x dp_size; DP rank r takes part r of each slice (Megatron-Core's sampler).
    """
    base = consumed_samples + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
    rows = torch.stack([source[base + j] for j in range(micro_batch_size)])
    return rows[:, :-1], rows[:, 1:]
