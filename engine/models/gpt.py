"""GPT-family decoder: GPT-2 style (LayerNorm, learned positions, GeLU, biases, tied embeddings)
and Llama style (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases) from one class.

The model holds no parallelism logic: tensor and sequence parallelism come from the parallel
layers it is built from, so this file reads like a single-device model. Activations inside are
[sequence, batch, hidden]; inputs and outputs are [batch, sequence] like any PyTorch model.

A pipeline stage is the same class with a slice of the layers (Megatron-Core's names):
`pre_process` holds the embeddings and takes token ids, `post_process` holds the final norm and
output layer, and a stage in between maps hidden states to hidden states. With tied embeddings
split over stages, the last stage keeps its own copy of the embedding weight (placed as a
`tied_copy`, initialised from the same name) whose gradient is summed with the first
stage's after backward, so the two stay equal.

Under context parallelism each rank holds two chunks of every sequence (see
engine.transformer.context_parallel): its positions (RoPE angles, learned position embeddings)
are the global positions of those chunks, and sequence parallelism then splits that local
sequence further over TP.

Packed rows (several samples per row, `packed_seq_params`): every stage is given the row's
position ids and segment ids; positions restart per sample (the RoPE angles and learned position
embeddings are gathered per token, a sequence-parallel rank taking its chunk's) and attention is
block-diagonal causal. Without them the path is exactly the unpacked one.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine import parallel_state as ps
from engine.models.language_model import LanguageModel
from engine.parallel_placement import set_placement
from engine.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, mark_sequence_parallel
from engine.transformer import context_parallel
from engine.transformer.config import TransformerConfig
from engine.transformer.dropout import dropout
from engine.transformer.kv_cache import KVCache
from engine.transformer.moe.moe_layer import local_experts
from engine.transformer.mtp import MultiTokenPrediction
from engine.transformer.packed_seq import PackedSeqParams
from engine.transformer.rope import RotaryEmbedding
from engine.transformer.transformer_layer import TransformerBlock

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


class GPTModel(LanguageModel):
    def __init__(
        self,
        config: TransformerConfig,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        layer_offset: int = 0,
        num_layers: int | None = None,
    ):
        super().__init__(config, pre_process=pre_process, post_process=post_process, layer_offset=layer_offset)
        c = config
        tie_across_stages = c.tie_embeddings and not (pre_process and post_process)
        # The last stage's MTP depths embed tokens too: without tying, a copy of the embedding
        # lives there, kept equal to the first stage's like a tied output weight.
        mtp_copy = c.mtp_num_layers > 0 and not (pre_process and post_process) and not c.tie_embeddings
        self.embedding = self.position_embeddings = None
        if pre_process:
            self.embedding = VocabParallelEmbedding(
                c.padded_vocab_size,
                c.hidden_size,
                sequence_parallel=c.sequence_parallel,
                params_dtype=c.params_dtype,
                init_std=c.init_method_std,
            )
            set_placement(self.embedding.weight, tied_embedding=tie_across_stages or mtp_copy)
            if c.position_embedding == "learned_absolute":
                self.position_embeddings = nn.Embedding(c.seq_length, c.hidden_size, dtype=c.params_dtype)
                set_placement(self.position_embeddings.weight, init_std=c.init_method_std)
                # Under SP each rank adds only its chunk's positions: the grad is a partial sum over TP.
                mark_sequence_parallel(self.position_embeddings, c.sequence_parallel)
        self.rotary = None
        if c.position_embedding == "rope":
            self.rotary = RotaryEmbedding(c.rotary_dim, c.rotary_base, c.rope_scaling)
        self.decoder = TransformerBlock(
            c, num_layers=num_layers, post_layer_norm=post_process, layer_offset=layer_offset
        )
        self.output_layer = None
        if post_process:
            # Tied on one stage: the embedding's vocabulary shard is also the output weight shard.
            self.output_layer = ColumnParallelLinear(
                c.hidden_size,
                c.padded_vocab_size,
                bias=False,
                sequence_parallel=c.sequence_parallel,
                params_dtype=c.params_dtype,
                init_std=c.init_method_std,
                skip_weight_param_allocation=c.tie_embeddings and pre_process,
            )
            if tie_across_stages:
                set_placement(self.output_layer.weight, tied_embedding=True, tied_copy=True)
        self.mtp = self.mtp_embedding = None
        if post_process and c.mtp_num_layers:
            self.mtp = MultiTokenPrediction(c)
            if not pre_process:
                self.mtp_embedding = VocabParallelEmbedding(
                    c.padded_vocab_size,
                    c.hidden_size,
                    sequence_parallel=c.sequence_parallel,
                    params_dtype=c.params_dtype,
                    init_std=c.init_method_std,
                )
                if c.tie_embeddings:  # the output weight is the embedding's copy already
                    self.mtp_embedding.weight = self.output_layer.weight
                else:
                    set_placement(self.mtp_embedding.weight, tied_embedding=True, tied_copy=True)

    def fsdp_units(self) -> list[nn.Module]:
        """What data-parallel parameter sharding gathers at once, in forward order: one
        transformer layer each; the other parameters (embeddings, final norm, output layer)
        form the model's own unit."""
        return list(self.decoder.layers)

    def global_param_name(self, name: str) -> str:
        """The parameter's name in the whole (unsplit) model: layer numbers are global, and the
        last stage's tied output weight is the embedding."""
        e = _EXPERT.search(name)
        if e:  # local expert j of this expert-parallel rank -> its global index
            j = int(e.group(1)) + local_experts(self.config.moe.num_experts)[0]
            name = f"{name[: e.start()]}.experts.local_experts.{j}.{name[e.end() :]}"
        m = _LAYER.match(name)
        if m:
            return f"decoder.layers.{int(m.group(1)) + self.layer_offset}.{name[m.end() :]}"
        if name == "output_layer.weight" and self.config.tie_embeddings:
            return "embedding.weight"
        if name == "mtp_embedding.weight":  # the last stage's copy for the MTP depths
            return "embedding.weight"
        return name

    def _embed(
        self, ids: torch.Tensor, packed: PackedSeqParams | None = None, rows_at: torch.Tensor | None = None
    ) -> torch.Tensor:
        """ids [s, b] (this CP rank's tokens) -> [s, b, h], or this rank's sequence chunk
        [s/tp, b, h] under SP. `rows_at` [s, b]: each token's position in its row (decoding)."""
        x = self.embedding(ids)
        if self.position_embeddings is not None:
            s = ids.shape[0]
            per_token = packed is not None or rows_at is not None
            if packed is not None:  # [s, b]: each token's position in its own sample
                positions = packed.position_ids.t()
            elif rows_at is not None:
                positions = rows_at
            else:
                positions = context_parallel.local_positions(s * context_parallel.cp_size(), ids.device)
            if self.config.sequence_parallel:
                tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
                chunk = s // tp
                positions = positions[rank * chunk : (rank + 1) * chunk]
            embedded = self.position_embeddings(positions)
            x = x + (embedded if per_token else embedded.unsqueeze(1))
        return dropout(x, self.config.hidden_dropout, self.training, self.config.sequence_parallel)

    def _rotary(
        self,
        local_seq: int,
        dtype: torch.dtype,
        packed: PackedSeqParams | None = None,
        kv_cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (cos, sin) at the global positions of this CP rank's `local_seq` tokens; for
        packed rows [s, b, 1, head_dim] at each token's position in its sample; with a KV cache
        at each token's position in its row."""
        if kv_cache is not None:
            cos, sin = self.rotary(kv_cache.max_len, dtype)
            index = kv_cache.positions(local_seq).t()
            return cos[index].squeeze(3), sin[index].squeeze(3)
        cp = context_parallel.cp_size()
        cos, sin = self.rotary(local_seq * cp, dtype)
        if packed is not None:  # no CP with packing (job spec); positions < local_seq
            index = packed.position_ids.t()
            return cos[index].squeeze(3), sin[index].squeeze(3)
        if cp == 1:
            return cos, sin
        return context_parallel.shard_sequence(cos, 0), context_parallel.shard_sequence(sin, 0)

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        mtp_labels: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """First stage: token ids [b, s] (this CP rank's two chunks under CP); later stages:
        hidden states [s, b, h] (a sequence chunk under SP). Last stage: per-token loss [b, s]
        when labels are given, else this rank's vocabulary slice of the logits [b, s, vocab/tp].
        Other stages return hidden states. `packed_seq_params`: the rows' position and segment
        ids [b, s] when they hold several samples each (every stage needs them). `mtp_labels`
        [b, s]: the labels, for the multi-token prediction depths (last stage; training only).
        `kv_cache` (one stage holding the whole model, no packing, no CP): the tokens [b, s]
        continue each row at the cache's `starts`; the cache keeps their keys and values."""
        packed = packed_seq_params
        if self.pre_process:
            rows_at = kv_cache.positions(x.shape[1]).t() if kv_cache is not None else None
            x = self._embed(x.t(), packed, rows_at)
        seq = x.shape[0] * (ps.get_tensor_model_parallel_world_size() if self.config.sequence_parallel else 1)
        rotary = self._rotary(seq, x.dtype, packed, kv_cache) if self.rotary is not None else None
        mask = packed.attention_mask() if packed is not None else None
        if kv_cache is not None:
            mask = kv_cache.attention_mask(seq)
        x = self.decoder(x, rotary, mask, kv_cache)
        if not self.post_process:
            return x
        if self.mtp is not None and mtp_labels is not None:
            x = self.mtp(x, mtp_labels, rotary, self._mtp_embed, self._logits)
        return self._loss_or_logits(self._logits(x), labels)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> this rank's vocabulary slice of the logits [s, b, vocab/tp]."""
        tied_here = self.config.tie_embeddings and self.pre_process
        return self._mask_vocab_padding(self.output_layer(x, weight=self.embedding.weight if tied_here else None))

    def _mtp_embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] -> [s, b, h] (a sequence chunk under SP), for the MTP depths."""
        return (self.embedding if self.pre_process else self.mtp_embedding)(tokens.t())
