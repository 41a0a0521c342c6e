"""T5 encoder-decoder (T5 v1.1 / transformers' T5 with an LM head), from the same
parallel layers as GPTModel and with its interface: no parallelism logic here, activations
[s, b, h] inside, per-token loss [b, s] (or logits [b, s, vocab/tp]) out of the last stage.

Inputs. `tokens` (the positional input of the first stage) are the encoder's ids; a T5 data
source (engine/data/span_corruption.py, seq2seq.py) hands the rest through the seam's keyword
inputs: `decoder_input_ids` [b, s] (the targets shifted right behind the decoder start id) and
`attention_mask` [b, s] (the encoder's padding, True/1 = a token). `labels` are the targets.

Pipeline parallelism (Megatron-Core's pipeline split rank): two stages, the encoder and the
shared embedding on the first (`pre_process`), the decoder and the LM head on the second
(`post_process`); the hidden state passed between them is the encoder output. The decoder stage
embeds its own ids with a copy of the shared embedding (`decoder_embedding`, placed as a
`tied_copy` of `embedding.weight`: initialised from the same name, its gradient summed with the
first stage's after backward, as GPT keeps a tied output weight across stages). With a tied LM
head that copy is also the output weight.

LM head: tied (the embedding) or untied (`output_layer`); `model.t5.scale_decoder_outputs`
multiplies the decoder output by hidden_size**-0.5 before it (original T5 with a tied head).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.language_model import LanguageModel
from engine.parallel_placement import set_placement
from engine.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from engine.transformer.config import TransformerConfig
from engine.transformer.dropout import dropout
from engine.transformer.t5_layers import T5Stack

# The seam's keyword inputs a T5 model reads (TokenSource.model_inputs of its sources).
T5_MODEL_INPUTS = ("decoder_input_ids", "attention_mask")


class T5Model(LanguageModel):
    splits_layers_over_stages = False  # the encoder | decoder stages, each a whole stack

    def __init__(
        self,
        config: TransformerConfig,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        layer_offset: int = 0,
        num_layers: int | None = None,
    ):
        """`pre_process`: this stage holds the encoder; `post_process`: the decoder. (The layer
        arguments, for families split by layers, do not apply: each stage holds a whole stack.)"""
        super().__init__(config, pre_process=pre_process, post_process=post_process)
        c = config
        split = not (pre_process and post_process)

        def embedding() -> VocabParallelEmbedding:
            return VocabParallelEmbedding(
                c.padded_vocab_size,
                c.hidden_size,
                sequence_parallel=c.sequence_parallel,
                params_dtype=c.params_dtype,
                init_std=c.init_method_std,
            )

        self.embedding = self.encoder = self.decoder = self.decoder_embedding = self.output_layer = None
        if pre_process:
            self.embedding = embedding()
            set_placement(self.embedding.weight, tied_embedding=split)
            self.encoder = T5Stack(c, c.num_layers, decoder=False)
        if post_process:
            if split:  # the decoder stage's copy of the shared embedding
                self.decoder_embedding = embedding()
                set_placement(self.decoder_embedding.weight, tied_embedding=True, tied_copy=True)
            self.decoder = T5Stack(c, c.t5.num_decoder_layers, decoder=True)
            self.output_layer = ColumnParallelLinear(
                c.hidden_size,
                c.padded_vocab_size,
                bias=False,
                sequence_parallel=c.sequence_parallel,
                params_dtype=c.params_dtype,
                init_std=c.init_method_std,
                skip_weight_param_allocation=c.tie_embeddings,
            )

    def fsdp_units(self) -> list[nn.Module]:
        """One layer each, in forward order (encoder, then decoder); the rest is the model's unit."""
        return [*(self.encoder.layers if self.encoder else []), *(self.decoder.layers if self.decoder else [])]

    def global_param_name(self, name: str) -> str:
        """The decoder stage's copy of the embedding is the embedding."""
        return "embedding.weight" if name == "decoder_embedding.weight" else name

    def _embed(self, table: VocabParallelEmbedding, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> [s, b, h] (a sequence chunk under SP)."""
        c = self.config
        return dropout(table(ids.t()), c.hidden_dropout, self.training, c.sequence_parallel)

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        packed_seq_params=None,
        mtp_labels: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """First stage: encoder ids [b, s]; the decoder stage alone: the encoder output [s, b, h].
        Returns the encoder output (first of two stages), else the per-token loss [b, s] with
        `labels`, or this rank's vocabulary slice of the logits [b, s, vocab/tp]."""
        if packed_seq_params is not None or mtp_labels is not None:
            raise ValueError("model.arch t5 has no packed rows and no multi-token prediction")
        if self.pre_process:
            x = self.encoder(self._embed(self.embedding, x), padding=attention_mask)
            if not self.post_process:
                return x
        if decoder_input_ids is None:
            raise ValueError(
                "model.arch t5 needs decoder_input_ids from its data source: use data.source span_corruption or "
                "seq2seq"
            )
        table = self.embedding if self.pre_process else self.decoder_embedding
        y = self.decoder(
            self._embed(table, decoder_input_ids), encoder_output=x, encoder_padding=attention_mask
        )
        if self.config.t5.scale_decoder_outputs:
            y = y * self.config.hidden_size**-0.5
        logits = self._mask_vocab_padding(
            self.output_layer(y, weight=table.weight if self.config.tie_embeddings else None)
        )
        return self._loss_or_logits(logits, labels)
