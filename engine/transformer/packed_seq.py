"""What a model needs to know about a packed row (Megatron-Core's `PackedSeqParams`).

A packed row holds several samples side by side (engine.data.packing). For the model to treat
each as if it were alone in its row it needs, per token, the sample's position (restarting at 0
with each sample: RoPE angles, learned position embeddings) and which sample it belongs to, so
that attention is block-diagonal causal. Without it (None) the model takes its usual path:
positions 0..s-1 and plain causal attention, bit for bit.

The mask is a dense boolean [b, 1, s, s] for torch's scaled_dot_product_attention, built once
per forward and shared by the layers: O(s^2) memory per row, fine at the sequence lengths the
CPU and SDPA paths run. A varlen kernel (flash-attention's cu_seqlens) is the way to long
packed sequences on GPUs and would take the same two tensors.

The class is a registered pytree dataclass so that torch's pipeline schedules cut its tensors
into microbatches along the batch dimension, as they cut the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedSeqParams:
    position_ids: torch.Tensor  # [b, s] long: each token's position within its own sample
    segment_ids: torch.Tensor  # [b, s] int: which sample of the row a token belongs to

    def attention_mask(self) -> torch.Tensor:
        """[b, 1, s, s] bool, True where query i may attend to key j: same sample and j <= i.
        Every token sees itself, so no row of the mask is empty (no NaN from the softmax)."""
        seg = self.segment_ids
        s = seg.shape[1]
        same = seg[:, :, None] == seg[:, None, :]
        causal = torch.ones(s, s, dtype=torch.bool, device=seg.device).tril()
        return (same & causal).unsqueeze(1)

    def to(self, device: torch.device | str) -> PackedSeqParams:
        return PackedSeqParams(self.position_ids.to(device), self.segment_ids.to(device))


torch.export.register_dataclass(PackedSeqParams, serialized_type_name="elastron.PackedSeqParams")
