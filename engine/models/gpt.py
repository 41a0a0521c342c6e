"""GPT-family decoder: GPT-2 style (LayerNorm, learned positions, GeLU, biases, tied embeddings)
and Llama style (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases) from one class.

The model holds no parallelism logic: tensor and sequence parallelism come from the parallel
layers it is built from, so this file reads like a single-device model. Activations inside are
[sequence, batch, hidden]; inputs and outputs are [batch, sequence] like any PyTorch model.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import parallel_state as ps
from engine.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    vocab_parallel_cross_entropy,
)
from engine.tensor_parallel.layers import set_partition
from engine.transformer.config import TransformerConfig
from engine.transformer.dropout import dropout
from engine.transformer.rope import RotaryEmbedding
from engine.transformer.transformer_layer import TransformerBlock


class GPTModel(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        c = config
        self.embedding = VocabParallelEmbedding(
            c.padded_vocab_size,
            c.hidden_size,
            sequence_parallel=c.sequence_parallel,
            params_dtype=c.params_dtype,
            init_std=c.init_method_std,
        )
        if c.position_embedding == "learned_absolute":
            self.position_embeddings = nn.Embedding(c.seq_length, c.hidden_size, dtype=c.params_dtype)
            set_partition(self.position_embeddings.weight, (c.seq_length, c.hidden_size), None)
            self.position_embeddings.weight.init_std = c.init_method_std
            # Under SP each rank adds only its chunk's positions: the grad is a partial sum over TP.
            mark_sequence_parallel(self.position_embeddings, c.sequence_parallel)
            self.rotary = None
        else:
            self.position_embeddings = None
            self.rotary = RotaryEmbedding(c.head_dim, c.rotary_base)
        self.decoder = TransformerBlock(c)
        # Tied: the embedding's vocabulary shard is also the output layer's weight shard.
        self.output_layer = ColumnParallelLinear(
            c.hidden_size,
            c.padded_vocab_size,
            bias=False,
            sequence_parallel=c.sequence_parallel,
            params_dtype=c.params_dtype,
            init_std=c.init_method_std,
            skip_weight_param_allocation=c.tie_embeddings,
        )

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [s, b] -> [s, b, h], or this rank's sequence chunk [s/tp, b, h] under SP."""
        x = self.embedding(ids)
        if self.position_embeddings is not None:
            s = ids.shape[0]
            positions = torch.arange(s, device=ids.device)
            if self.config.sequence_parallel:
                tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
                chunk = s // tp
                positions = positions[rank * chunk : (rank + 1) * chunk]
            x = x + self.position_embeddings(positions).unsqueeze(1)
        return dropout(x, self.config.hidden_dropout, self.training, self.config.sequence_parallel)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [b, s] -> per-token loss [b, s] when labels are given, else this rank's
        vocabulary slice of the logits [b, s, vocab/tp]."""
        ids = input_ids.t()
        x = self._embed(ids)
        rotary = self.rotary(ids.shape[0], x.dtype) if self.rotary is not None else None
        x = self.decoder(x, rotary)
        logits = self.output_layer(x, weight=self.embedding.weight if self.config.tie_embeddings else None)
        if labels is None:
            return logits.transpose(0, 1)
        return vocab_parallel_cross_entropy(logits, labels.t()).t()
