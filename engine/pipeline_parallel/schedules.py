"""Pipeline schedules on torch.distributed.pipelining.

torch's PipelineStage and its Schedule1F1B / ScheduleInterleaved1F1B implement Megatron-Core's
1F1B and interleaved 1F1B orders (warm-up forwards, steady one-forward-one-backward, cool-down)
with p2p over the pipeline group, and run on CPU/gloo and CUDA/NCCL, so no schedule is written by
hand here. What this module adds is the glue to the rest of the engine:
- the layer split: Megatron-Core's virtual stage v * pp + r on pipeline rank r, even by default,
  uneven from `parallel.pipeline_layers`;
- the loss: the last stage computes the vocab-parallel cross entropy per microbatch, weighted as
  the Trainer says (its share of the global batch's mean, times the fp16 loss scale), so torch's
  own grad scaling is off (`scale_grads=False`): gradients go straight into the data-parallel
  buffers;
- packed rows: their PackedSeqParams go to every stage as a keyword argument of the model, cut
  into microbatches by the schedule like the tokens (it is a registered pytree dataclass); so do
  a source's further model inputs (`inputs`, e.g. an encoder-decoder's decoder ids), each its own
  keyword argument;
- data-parallel gradient sync needs nothing from the schedule: the buffers count each
  parameter's backward passes and reduce a bucket after its last microbatch;
- one schedule object per number of microbatches (a batch-size ramp changes it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from engine.transformer.packed_seq import PackedSeqParams


def stage_layer_ranges(
    num_layers: int, stages: int, pipeline_layers: list[int] | None
) -> list[tuple[int, int]]:
    """(first layer, layer count) of every virtual stage, in stage order."""
    counts = list(pipeline_layers) if pipeline_layers else [num_layers // stages] * stages
    if len(counts) != stages or sum(counts) != num_layers:
        raise ValueError(f"pipeline_layers {counts} must list {stages} stages adding up to {num_layers}")
    offsets = [sum(counts[:i]) for i in range(stages)]
    return list(zip(offsets, counts, strict=True))


def virtual_stages_of(pp_rank: int, pp: int, vp: int) -> list[int]:
    """Stage indices held by a pipeline rank: its model chunk v is virtual stage v * pp + rank."""
    return [v * pp + pp_rank for v in range(vp)]


class PipelineRunner:
    """Runs one global batch's microbatches through this rank's stages."""

    def __init__(
        self,
        chunks: list[nn.Module],
        stage_indices: list[int],
        num_stages: int,
        group: dist.ProcessGroup,
        device: torch.device,
    ):
        self.stages = [
            PipelineStage(chunk, idx, num_stages, device, group=group)
            for chunk, idx in zip(chunks, stage_indices, strict=True)
        ]
        self.interleaved = len(self.stages) > 1
        self.has_first = 0 in stage_indices
        self.has_last = num_stages - 1 in stage_indices
        self._schedules: dict[int, object] = {}
        self._loss_fn: Callable | None = None

    def _schedule(self, num_microbatches: int):
        if num_microbatches not in self._schedules:
            loss_fn = lambda out, target: self._loss_fn(out, target)  # noqa: E731 - set per step
            if self.interleaved:
                sched = ScheduleInterleaved1F1B(
                    self.stages, num_microbatches, loss_fn=loss_fn, scale_grads=False
                )
            else:
                sched = Schedule1F1B(self.stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
            self._schedules[num_microbatches] = sched
        return self._schedules[num_microbatches]

    def run(
        self,
        num_microbatches: int,
        tokens: torch.Tensor | None,
        labels: torch.Tensor | None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        packed: PackedSeqParams | None = None,
        mtp: bool = False,
        inputs: dict[str, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """`tokens` [M * mbs, s] on the rank holding the first stage, `labels` on the last,
        `packed` (rows holding several samples, [M * mbs, s]) and `inputs` (the model's further
        keyword inputs, [M * mbs, ...] each) on every rank.
        `loss_fn(logits, labels)` returns the microbatch's loss to backpropagate. Returns those
        losses (detached) on the last stage, [] elsewhere.

        Count losses from the schedule, not from calls to loss_fn: on its first step torch calls
        loss_fn once more to infer backward metadata (autograd.grad on the stage inputs only, so
        parameters and the data-parallel buffers see nothing)."""
        return self._drive(
            num_microbatches, tokens, labels, loss_fn, packed, forward_only=False, mtp=mtp, inputs=inputs
        )

    @torch.no_grad()
    def evaluate(
        self,
        num_microbatches: int,
        tokens: torch.Tensor | None,
        labels: torch.Tensor | None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        packed: PackedSeqParams | None = None,
        inputs: dict[str, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Forward only (the schedule's eval pass): per-microbatch losses on the last stage."""
        return self._drive(num_microbatches, tokens, labels, loss_fn, packed, forward_only=True, inputs=inputs)

    def _drive(
        self, num_microbatches, tokens, labels, loss_fn, packed, forward_only: bool, mtp: bool = False, inputs=None
    ) -> list[torch.Tensor]:
        self._loss_fn = loss_fn
        sched = self._schedule(num_microbatches)
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.has_first else ()
        kwargs = {"target": labels, "losses": losses} if self.has_last else {}
        if packed is not None:
            kwargs["packed_seq_params"] = packed
        kwargs.update(inputs or {})
        if mtp and self.has_last:  # the multi-token prediction depths read the labels
            kwargs["mtp_labels"] = labels
        (sched.eval if forward_only else sched.step)(*args, **kwargs)
        return [loss.detach() for loss in losses]
