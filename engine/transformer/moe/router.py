"""Top-k router: which experts each token goes to, with what weight, and the balancing losses.

Computed in fp32 whatever the model's precision (routing decisions flip on rounding otherwise).
Scores are softmax or sigmoid over the router's logits; the top k scores pick the experts, and
with `expert_bias` (aux-loss-free balancing, DeepSeek-V3's rule) the pick uses score + bias while
the gate weights stay the unbiased scores. With `norm_topk_prob` the k chosen gates are divided
by their sum (Mixtral and Qwen3-MoE in transformers: softmax over all experts, top k, divide;
Megatron-Core's default softmax over the top-k logits is the same); by default sigmoid gates are
(top_k > 1) and softmax gates are not. The balancing losses use the scores before that.

Balancing losses, per micro-batch, as in Megatron-Core:
- auxiliary (Switch/GShard): coeff * E / (T^2 * k) * sum_e P_e * n_e, where P_e is the sum over
  the T tokens of expert e's score and n_e the number of tokens routed to e (before capacity
  dropping), so it is coeff * E * sum_e mean-score_e * fraction_e;
- z-loss: coeff * mean over tokens of logsumexp(logits)^2 (keeps the logits small).
Under sequence parallelism each TP rank routes its own chunk of the micro-batch: n_e and T are
summed over the TP group (no gradient flows through counts) while P_e and the z-loss's sum stay
local, so the TP ranks' losses add up to the single-rank value and, since the router weight is
marked sequence-parallel (its grad is summed over TP), so do its gradients.

Capacity (optional): each expert takes at most ceil(T * k / E * capacity_factor) tokens of this
rank's micro-batch; beyond that the lowest-scored assignments are dropped (their gate is 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine import parallel_state as ps
from engine.parallel_placement import set_placement
from engine.tensor_parallel import mark_sequence_parallel


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int | None = None
    score: str = "softmax"  # "softmax" | "sigmoid"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    capacity_factor: float | None = None
    norm_topk_prob: bool | None = None  # None: sigmoid with top_k > 1 only
    num_groups: int | None = None  # group-limited routing (DeepSeek-V3), with topk_group
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    seq_aux_loss: bool = False  # the balancing loss per sequence, averaged (DeepSeek-V3)
    layers: tuple[bool, ...] = ()  # which layers are MoE (global layer index)

    @property
    def normalizes_gates(self) -> bool:
        """Whether the k chosen gate weights are divided by their sum."""
        if self.norm_topk_prob is not None:
            return self.norm_topk_prob
        return self.score == "sigmoid" and self.top_k > 1


@dataclass
class Routing:
    """indices/gates: [T, k]; kept: [T, k] bool (False = dropped for capacity); aux: the
    balancing losses to add to the objective (a 0-dim tensor with a graph)."""

    indices: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor
    dropped: int


class TopKRouter(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        params_dtype: torch.dtype,
        init_std: float,
        sequence_parallel: bool,
    ):
        super().__init__()
        self.moe = moe
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=params_dtype))
        set_placement(self.weight, init_std=init_std)
        mark_sequence_parallel(self, sequence_parallel)
        # Aux-loss-free balancing: a bias moved after every step toward under-used experts.
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts), persistent=True)
        self.register_buffer("step_tokens_per_expert", torch.zeros(moe.num_experts), persistent=False)

    def _global_counts(self, counts: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        if self.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
            counts = counts.clone()
            dist.all_reduce(counts, group=ps.get_tensor_model_parallel_group())
            tokens *= ps.get_tensor_model_parallel_world_size()
        return counts, tokens

    def forward(self, x: torch.Tensor, sequences: int = 1) -> Routing:
        """x: [T, h] this rank's tokens, position-major over `sequences` sequences ([s, b] flattened)."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = torch.softmax(logits, dim=-1) if moe.score == "softmax" else torch.sigmoid(logits)
        pick = scores + self.expert_bias if moe.expert_bias else scores
        if moe.num_groups is not None:
            pick = self._within_best_groups(pick)
        indices = pick.topk(moe.top_k, dim=-1).indices
        gates = scores.gather(1, indices)
        if moe.normalizes_gates:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        if moe.routed_scaling_factor != 1.0:
            gates = gates * moe.routed_scaling_factor
        counts = torch.zeros(moe.num_experts, device=x.device).index_add_(
            0, indices.reshape(-1), torch.ones(indices.numel(), device=x.device)
        )
        if moe.expert_bias and self.training:
            self.step_tokens_per_expert += counts.detach()
        aux = logits.new_zeros(())
        if moe.aux_loss_coeff > 0 or moe.z_loss_coeff > 0:
            n, tokens = self._global_counts(counts, x.shape[0])  # the whole micro-batch's
        if moe.aux_loss_coeff > 0 and moe.seq_aux_loss:
            aux = aux + self._sequence_aux_loss(scores, indices, sequences)
        elif moe.aux_loss_coeff > 0:
            scale = moe.aux_loss_coeff * moe.num_experts / (tokens * tokens * moe.top_k)
            aux = aux + scale * (scores.sum(dim=0) * n).sum()
        if moe.z_loss_coeff > 0:  # a mean over the micro-batch: this rank's share of the sum
            aux = aux + moe.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().sum() / tokens
        kept = torch.ones_like(indices, dtype=torch.bool)
        dropped = 0
        if moe.capacity_factor is not None:
            kept = self._within_capacity(indices, gates, x.shape[0])
            dropped = int((~kept).sum())
        return Routing(indices, gates, kept, counts, aux, dropped)

    def _within_best_groups(self, pick: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (DeepSeek-V3): each token keeps only the experts of its topk_group
        groups with the highest sum of their two best pick scores; the others get -inf."""
        moe = self.moe
        t, e = pick.shape
        per_group = e // moe.num_groups
        group_scores = pick.view(t, moe.num_groups, per_group).topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(moe.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return pick.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))

    def _sequence_aux_loss(self, scores: torch.Tensor, indices: torch.Tensor, sequences: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balancing loss, averaged over the micro-batch's sequences:
        coeff * sum_e f_e * P_e per sequence, f_e = E / (k * S) * (tokens of the sequence routed to
        e), P_e = the mean over its S tokens of e's normalised score. Under sequence parallelism
        the counts are summed over TP (no gradient) and S is the whole sequence, while each rank's
        P part stays local, so the ranks' losses add up to the single-rank value."""
        moe = self.moe
        e, k, b = moe.num_experts, moe.top_k, sequences
        s = scores.shape[0] // b
        probs = (scores / scores.sum(dim=-1, keepdim=True)).view(s, b, e).sum(dim=0)  # [b, E]
        picks = indices.view(s, b, k).permute(1, 0, 2).reshape(b, s * k)
        counts = torch.zeros(b, e, device=scores.device).scatter_add_(
            1, picks, torch.ones_like(picks, dtype=torch.float)
        )
        counts, tokens = self._global_counts(counts, s)  # tokens: the whole sequence's length
        return moe.aux_loss_coeff * e / (k * tokens * tokens * b) * (counts * probs).sum()

    def _within_capacity(self, indices: torch.Tensor, gates: torch.Tensor, tokens: int) -> torch.Tensor:
        """Per expert, keep its `capacity` highest-gated assignments."""
        moe = self.moe
        capacity = math.ceil(tokens * moe.top_k / moe.num_experts * moe.capacity_factor)
        flat_e, flat_g = indices.reshape(-1), gates.detach().reshape(-1)
        kept = torch.zeros_like(flat_e, dtype=torch.bool)
        for e in range(moe.num_experts):
            slots = (flat_e == e).nonzero().squeeze(1)
            if slots.numel() > capacity:
                slots = slots[flat_g[slots].topk(capacity).indices]
            kept[slots] = True
        return kept.view_as(indices)

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None) -> None:
        """After the optimizer step: nudge each expert's bias by rate * sign(mean load - its load),
        with the step's token counts summed over `group` (every rank that routed tokens)."""
        counts = self.step_tokens_per_expert
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        self.expert_bias += self.moe.expert_bias_update_rate * torch.sign(counts.mean() - counts)
        counts.zero_()
