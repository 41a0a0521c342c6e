"""Multi-token prediction (DeepSeek-V3; Megatron-Core's `mtp`): D extra prediction depths after the
decoder, sharing its embedding and output layer.

Depth k (1..D) predicts token i + k + 1 at position i from the previous depth's hidden state
h^{k-1}_i (h^0: the decoder's output) and the embedding of token i + k:

    h^k = TransformerLayer_k(eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1})]))
    L_k = cross entropy of output_layer(final_layernorm_k(h^k)) against t_{i+k+1}

The tokens t_{i+k} are read from the labels (label i is token i + 1), so the last pipeline stage,
where the depths live, needs nothing the schedule does not already give it. Positions whose
target falls past the sequence take no loss. The objective adds mtp_loss_scaling_factor / D x
sum_k L_k, each L_k the mean over the global batch's tokens that have a depth-k target: its
gradient is attached to h^0 in backward (engine.transformer.loss_attach), so the main loss the schedule sees and
reports stays the main loss, and the depths' own losses are reported beside it.

eh_proj is replicated over TP like the norms (under SP each rank projects its sequence chunk:
its grad is summed over TP).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel_placement import set_placement
from engine.tensor_parallel import mark_sequence_parallel, vocab_parallel_cross_entropy
from engine.tensor_parallel.cross_entropy import IGNORE_INDEX
from engine.transformer.config import TransformerConfig
from engine.transformer.loss_attach import attach_loss
from engine.transformer.norm import build_norm
from engine.transformer.transformer_layer import TransformerLayer


def shifted(labels: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """labels [b, s] moved k positions left, the last k filled with `fill`."""
    if k == 0:
        return labels
    return torch.cat([labels[:, k:], labels.new_full((labels.shape[0], k), fill)], dim=1)


class MTPLayer(nn.Module):
    def __init__(self, config: TransformerConfig, moe: bool):
        super().__init__()
        h = config.hidden_size
        self.enorm = build_norm(config)
        self.hnorm = build_norm(config)
        self.eh_proj = nn.Module()
        self.eh_proj.weight = nn.Parameter(torch.empty(h, 2 * h, dtype=config.params_dtype))
        set_placement(self.eh_proj.weight, init_std=config.init_method_std)
        mark_sequence_parallel(self.eh_proj, config.sequence_parallel)
        self.transformer_layer = TransformerLayer(config, moe=moe)
        self.final_layernorm = build_norm(config)


class MultiTokenPrediction(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            MTPLayer(config, moe=config.moe is not None) for _ in range(config.mtp_num_layers)
        )
        # Set by the Trainer before each step: each depth's loss weight (scaling factor / D x
        # dp*cp x loss scale / that depth's global target count). None: the local mean.
        self.loss_weights: list[float] | None = None
        self.depth_sums: list[torch.Tensor] = []  # per forward: [D] summed token losses (detached)

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        embed: Callable[[torch.Tensor], torch.Tensor],
        logits_of: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """hidden: the decoder's output [s, b, h]; labels [b, s]. Returns `hidden` carrying the
        depths' weighted loss into backward."""
        c, depths = self.config, len(self.layers)
        total, sums, h = hidden.new_zeros((), dtype=torch.float32), [], hidden
        for k, layer in enumerate(self.layers, start=1):
            tokens = shifted(labels, k - 1, 0).clamp(min=0)  # token i + k (0 where past the end)
            target = shifted(labels, k, IGNORE_INDEX)  # token i + k + 1
            x = torch.cat([layer.enorm(embed(tokens)), layer.hnorm(h)], dim=-1)
            h = layer.transformer_layer(F.linear(x, layer.eh_proj.weight), rotary)
            logits = logits_of(layer.final_layernorm(h))  # [s, b, vocab/tp]
            loss = vocab_parallel_cross_entropy(logits, target.t()).float()  # [s, b], 0 where ignored
            depth_sum = loss.sum()
            sums.append(depth_sum.detach())
            if self.loss_weights is not None:
                weight = self.loss_weights[k - 1]
            else:
                weight = c.mtp_loss_scaling_factor / depths / max(int((target != IGNORE_INDEX).sum()), 1)
            total = total + weight * depth_sum
        if hidden.device.type != "meta":
            self.depth_sums.append(torch.stack(sums))
        return attach_loss(hidden, total) if total.requires_grad else hidden
