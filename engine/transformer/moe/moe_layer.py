"""The MoE feed-forward block: route, dispatch to the experts' ranks, run, combine (+ shared expert).

Takes and returns the layer's [s, b, h] activations (this rank's sequence chunk under sequence
parallelism, which MoE requires with TP > 1, as in Megatron-Core: every TP rank then routes
distinct tokens). The balancing losses do not travel through the model's outputs: they are
attached to the block's output by `attach_aux_loss`, whose backward feeds the aux loss its
gradient (scaled like the main loss), the way Megatron-Core's MoEAuxLossAutoScaler does.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import parallel_state as ps
from engine.transformer.loss_attach import attach_loss
from engine.transformer.moe.experts import LocalExperts
from engine.transformer.moe.router import MoEConfig, TopKRouter
from engine.transformer.moe.token_dispatcher import AllToAllDispatcher


def local_experts(num_experts: int) -> tuple[int, int]:
    """(global index of this rank's first expert, how many it holds): experts are split evenly
    and in order over the expert-parallel group."""
    if not ps.model_parallel_is_initialized():
        return 0, num_experts
    count = num_experts // ps.get_grid().ep
    return ps.get_rank_in("ep") * count, count


class MoELayer(nn.Module):
    def __init__(self, config, moe: MoEConfig):
        super().__init__()
        from engine.transformer.mlp import MLP  # the dense MLP, for the shared expert

        self.expert_offset, self.local_count = local_experts(moe.num_experts)
        ep_size = moe.num_experts // self.local_count
        self.moe = moe
        # What the main loss is multiplied by before backward (fp16 scale / microbatches): the
        # balancing losses get the same. The training objective sets it each step.
        self.aux_loss_scale = 1.0
        self.router = TopKRouter(
            config.hidden_size, moe, config.params_dtype, config.init_method_std, config.sequence_parallel
        )
        self.dispatcher = AllToAllDispatcher(moe.num_experts, ps.get_group("ep") if ep_size > 1 else None)
        self.experts = LocalExperts(
            self.local_count,
            hidden=config.hidden_size,
            ffn=moe.ffn_hidden_size,
            activation=config.activation,
            dtype=config.params_dtype,
            init_std=config.init_method_std,
            out_std=config.output_layer_init_std,
        )
        self.shared_expert = (
            MLP(config, ffn_hidden_size=moe.shared_expert_ffn_hidden_size)
            if moe.shared_expert_ffn_hidden_size
            else None
        )
        self.last_dropped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        routing = self.router(tokens, sequences=b)
        self.last_dropped = routing.dropped
        rows, per_expert = self.dispatcher.dispatch(tokens, routing.indices, routing.kept)
        y = self.experts(rows, per_expert)
        out = self.dispatcher.combine(y, routing.gates, routing.kept, s * b).view(s, b, h)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if routing.aux_loss.requires_grad:
            out = attach_loss(out, routing.aux_loss, self.aux_loss_scale)
        return out
