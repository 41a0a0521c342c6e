"""What a training step minimises, on one rank: the language-model loss as the mean over the
global batch's label tokens, the multi-token prediction depths' losses, and the MoE balancing
losses, each scaled so that the data-parallel gradient average and the fp16 loss scale give the
gradient of that mean whatever the layout.

The weights depend on the whole global batch (its label-token counts, a collective over DP x CP),
so the objective is told each step's batches first (`begin_step`) and hands back the loss
function the forward passes (or the pipeline schedule) call per microbatch. It keeps its
per-step settings on the modules that apply them (the MTP block's depth weights, each MoE
layer's `aux_loss_scale`), never in module globals: two Trainers in one process do not share them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.data.sft import IGNORE_INDEX
from engine.models import LanguageModel
from engine.transformer.moe import MoELayer
from engine.transformer.mtp import shifted

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def label_tokens(labels: Sequence[torch.Tensor]) -> torch.Tensor:
    """How many labels take a loss (fp32, on the device: no sync)."""
    return torch.stack([(x != IGNORE_INDEX).sum() for x in labels]).sum().float()


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The sum of the token losses of the labels that are not IGNORE_INDEX (fp32)."""
    loss = LanguageModel.loss_from_logits(logits, labels).float()
    return (loss * (labels != IGNORE_INDEX)).sum()


class ShareLosses:
    """The loss of each share a step trains (`TrainingObjective.begin_shares`): `of(i)` for the
    forward passes of share i, `tagged` for a pipeline schedule that runs every share's
    microbatches in one pass and calls one loss function for all of them: its targets carry
    their share's index as a last column (`tag`), so the weight is picked on the device, without
    a sync and without counting calls (torch's schedule calls the loss once more on its first
    step to infer shapes)."""

    def __init__(self, weights: torch.Tensor | None) -> None:
        self.weights = weights  # [shares] (None on pipeline stages that read no labels)

    def of(self, share: int) -> LossFn:
        weight = self.weights[share] if self.weights is not None else None

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return summed_token_loss(logits, labels) * weight

        return loss_fn

    @staticmethod
    def tag(labels: torch.Tensor, share: int) -> torch.Tensor:
        """`labels` [b, s] with a last column holding `share`: a target of `tagged`."""
        return torch.cat([labels, torch.full_like(labels[:, :1], share)], dim=1)

    def tagged(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of a microbatch whose target is `tag(labels, share)` (one share per microbatch)."""
        return summed_token_loss(logits, target[:, :-1]) * self.weights[target[0, -1]]


class TrainingObjective:
    """The step's loss of one rank's model chunks. `replicas` is dp x cp (the ranks whose
    gradients the data-parallel reduction averages); `reads_labels` is False on pipeline stages
    other than the last (they have no loss of their own)."""

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        mtp_num_layers: int,
        mtp_loss_scaling_factor: float,
        replicas: int,
        reads_labels: bool,
        pipelined: bool,
        device: torch.device,
    ):
        self.mtp = next((c.mtp for c in model_chunks if c.mtp is not None), None)
        self.mtp_depths, self.mtp_factor = mtp_num_layers, mtp_loss_scaling_factor
        # MoE layers, and any other module with a side loss weighted like theirs (BERT's binary head)
        self.moe_layers = [
            m for chunk in model_chunks for m in chunk.modules() if isinstance(m, MoELayer) or hasattr(m, "aux_loss_scale")
        ]
        self.replicas, self.reads_labels, self.pipelined = replicas, reads_labels, pipelined
        self.device = device
        self._mtp_counts: torch.Tensor | None = None

    def _all_reduce_replicas(self, t: torch.Tensor) -> None:
        if self.replicas > 1:
            dist.all_reduce(t, group=ps.get_group("dp_cp"))

    def begin_step(self, labels: Sequence[torch.Tensor], scale: float, num_microbatches: int) -> LossFn:
        """Set this step's weights from its microbatches' labels (those this rank reads) and
        return the per-microbatch loss: its share of the step's loss times the fp16 loss scale.

        A token's loss is multiplied by dp x cp x scale / (the global batch's count of label
        tokens): the data-parallel reduction averages gradients over DP x CP, so the sum over
        every microbatch and rank is the mean over the global batch's label tokens. So the loss
        does not depend on the layout or on which samples share a microbatch (a per-microbatch
        mean would weight a token by its microbatch's count of label tokens, which differs a lot
        between fine-tuning samples). A global batch without any label token (conversations
        whose assistant turns were all truncated away) has loss 0 and zero gradients, never
        NaN. A collective over dp_cp on the ranks that read labels."""
        return self.begin_shares([labels], scale, num_microbatches).of(0)

    def begin_shares(
        self, shares: Sequence[Sequence[torch.Tensor]], scale: float, num_microbatches: int
    ) -> ShareLosses:
        """begin_step for a step that trains several shares of the global batch: this rank's own
        (share 0) and those of replicas missing from the quorum that it takes
        (`resilience.lost_replica_share: redistribute`). Each share's tokens are weighted by its
        own count of label tokens, as begin_step weights a step's (one collective for all of
        them). The MTP depths are weighted by the own share's labels (the job spec refuses MTP
        with redistribute)."""
        for layer in self.moe_layers:  # balancing losses, scaled like the loss
            layer.aux_loss_scale = scale / num_microbatches
        weights = None
        if self.reads_labels:
            counts = torch.stack([label_tokens(labels) for labels in shares])
            self._all_reduce_replicas(counts)
            weights = (self.replicas * scale) / counts.clamp(min=1.0)
        self._set_mtp_weights(shares[0], scale)
        return ShareLosses(weights)

    def _set_mtp_weights(self, labels: Sequence[torch.Tensor], scale: float) -> None:
        """Multi-token prediction (last stage): each depth's loss weight for this step, so that
        its loss is the mean over the global batch's tokens that have a target at that depth
        (engine.transformer.mtp)."""
        self._mtp_counts = None
        if self.mtp is None:
            return
        d = self.mtp_depths
        local = torch.stack(
            [label_tokens([shifted(x, k, IGNORE_INDEX) for x in labels]) for k in range(1, d + 1)]
        )
        counts = local.clone()
        self._all_reduce_replicas(counts)
        factor = self.mtp_factor / d * self.replicas * scale
        self.mtp.loss_weights = [factor / max(n, 1.0) for n in counts.tolist()]
        self.mtp.depth_sums.clear()
        self._mtp_counts = local

    def mtp_loss(self, num_microbatches: int) -> float | None:
        """The step's multi-token prediction loss, the mean over depths of each depth's mean token
        loss, on every rank (a collective over DP x CP and the pipeline when MTP is on)."""
        d = self.mtp_depths
        if not d:
            return None
        vec = torch.zeros(2 * d, device=self.device)
        if self.mtp is not None:
            vec[:d] = torch.stack(self.mtp.depth_sums[-num_microbatches:]).sum(dim=0)
            vec[d:] = self._mtp_counts
        self._all_reduce_replicas(vec)
        if self.pipelined:
            dist.all_reduce(vec, group=ps.get_group("pp"))
        return float((vec[:d] / vec[d:].clamp(min=1.0)).mean())
