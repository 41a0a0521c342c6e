"""A step's microbatches, read where this rank needs them and put on its device.

Each data source reads its own microbatches (`micro_batch`: masked labels for fine-tuning, packed
rows' positions and sample ids); this module decides which ranks read (under pipelining only the
first and last stages, and every stage for packed rows), keeps a context-parallel rank's two
sequence chunks, and joins a step's microbatches for the pipeline schedule.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.transformer import context_parallel
from engine.transformer.packed_seq import PackedSeqParams


class MicroBatch(NamedTuple):
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s], IGNORE_INDEX where no loss is taken (fine-tuning masks)
    packed: PackedSeqParams | None = None  # rows holding several samples (data.packing)
    inputs: dict[str, torch.Tensor] | None = None  # the model's further keyword inputs, [b, ...] each


class StepBatches:
    """This rank's reader of global batches. `pipeline` is the rank's PipelineRunner (None
    without pipelining); `packing` is data.packing."""

    def __init__(self, micro_batch_size: int, dp_size: int, dp_rank: int, pipeline, packing: bool, device):
        self.micro_batch_size, self.dp_size, self.dp_rank = micro_batch_size, dp_size, dp_rank
        self.pipeline, self.packing, self.device = pipeline, packing, device

    def microbatch(self, source, consumed: int, m: int, dp_rank: int | None = None) -> MicroBatch:
        """This DP rank's microbatch m of the global batch starting at sample `consumed` (or DP rank
        `dp_rank`'s: the share of a replica missing from the step, taken by this one). Under
        context parallelism every CP rank of a DP replica reads the same microbatch and keeps its
        two sequence chunks of tokens and labels (no packing there)."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        b = source.micro_batch(consumed, m, self.micro_batch_size, self.dp_size, rank)
        inputs = {k: v.to(self.device) for k, v in b.inputs.items()} if b.inputs else None
        if b.position_ids is not None:
            packed = PackedSeqParams(b.position_ids, b.segment_ids).to(self.device)
            return MicroBatch(b.tokens.to(self.device), b.labels.to(self.device), packed, inputs)
        tokens, labels = (context_parallel.shard_sequence(x, 1) for x in (b.tokens, b.labels))
        return MicroBatch(tokens.to(self.device), labels.to(self.device), None, inputs)

    def read(self, source, consumed: int, n: int, dp_rank: int | None = None) -> list[MicroBatch]:
        """The step's n microbatches (of DP rank `dp_rank`'s share, default this rank's) where this
        rank reads them: every rank without pipelining; under it the first stage (tokens), the
        last (labels) and, for packed rows or a source with further model inputs, every stage
        (each needs the rows' positions and attention mask, or those inputs; reading is
        deterministic)."""
        runner = self.pipeline
        every_stage = self.packing or bool(getattr(source, "model_inputs", ()))
        if runner is None or runner.has_first or runner.has_last or every_stage:
            return [self.microbatch(source, consumed, m, dp_rank) for m in range(n)]
        return []

    def pipeline_inputs(self, batches: list[MicroBatch]):
        """(tokens, labels, packed, inputs) of the whole step for the pipeline schedule, which
        cuts them into microbatches again: tokens on the first stage, labels on the last, packing
        and the further model inputs on all."""
        runner = self.pipeline
        tokens = torch.cat([b.tokens for b in batches]) if runner.has_first else None
        labels = torch.cat([b.labels for b in batches]) if runner.has_last else None
        packed = None
        if self.packing:
            packed = PackedSeqParams(
                torch.cat([b.packed.position_ids for b in batches]),
                torch.cat([b.packed.segment_ids for b in batches]),
            )
        inputs = None
        if batches and batches[0].inputs:
            inputs = {k: torch.cat([b.inputs[k] for b in batches]) for k in batches[0].inputs}
        return tokens, labels, packed, inputs
