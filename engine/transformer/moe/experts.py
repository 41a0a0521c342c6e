"""The experts this rank holds, run one after another on their share of the tokens.

Each expert is a small MLP with the dense MLP's activation (model.activation), kept whole on its
expert-parallel rank (expert tensor parallel size 1). A loop over local experts is what runs on
CPU; a grouped GEMM (torch's grouped mm or Transformer Engine's GroupedLinear) is the GPU path
to add. Parameter names carry the local index; `GPTModel.global_param_name` turns it into the
global expert index (ep_rank * local_experts + j), so initialisation and checkpoints see the same
expert on any EP size. Expert parameters are marked `expert = True`: their gradients reduce over
the expert data-parallel group and every rank's experts count in the gradient norm.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.parallel_placement import set_placement
from engine.transformer import activations


class ExpertMLP(nn.Module):
    def __init__(
        self, hidden: int, ffn: int, activation: str, dtype: torch.dtype, init_std: float, out_std: float
    ):
        super().__init__()
        self.activation = activation
        self.linear_fc1 = nn.Linear(
            hidden, ffn * (2 if activations.is_gated(activation) else 1), bias=False, dtype=dtype
        )
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False, dtype=dtype)
        set_placement(self.linear_fc1.weight, init_std=init_std, expert=True)
        set_placement(self.linear_fc2.weight, init_std=out_std, expert=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activations.activation(self.linear_fc1(x), self.activation))


class LocalExperts(nn.Module):
    def __init__(self, count: int, **mlp_kwargs):
        super().__init__()
        self.local_experts = nn.ModuleList(ExpertMLP(**mlp_kwargs) for _ in range(count))

    def forward(self, rows: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        chunks = rows.split(rows_per_expert)
        outs = [expert(chunk) for expert, chunk in zip(self.local_experts, chunks, strict=True)]
        return torch.cat(outs) if outs else rows
