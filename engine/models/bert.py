"""BERT encoder with its masked-LM head, as transformers' masked-LM BERT computes it.

Bidirectional self-attention under a padding mask, learned absolute positions, token types,
post-LayerNorm layers (attention -> dropout -> add -> LayerNorm, then MLP(GELU) -> dropout ->
add -> LayerNorm, with a LayerNorm on the embeddings), and the MLM head: dense + GELU + LayerNorm,
then a decoder tied to the word embedding with a bias of its own. Built from the same parallel
layers as GPTModel (engine/models/gpt.py), so TP, SP, DP sharding, recompute and PP come from
them; the same stage conventions hold: `pre_process` holds the embeddings, `post_process` the MLM
head, and with the embedding tied across stages the last stage keeps a copy of it
(`tied_copy`) whose gradient is summed with the first stage's.

Inputs beyond the token ids come through the data source's `model_inputs` (engine/data/mlm.py):
`attention_mask` [b, s] (1: a real token, 0: padding; every stage needs it) and
`token_type_ids` [b, s] (the first stage). Without them every token attends to every other
and all token types are 0, as in transformers.

The optional binary head (`model.bert_binary_head`, the HF pretraining BERT's next-sentence head):
a pooler (dense + tanh) on [CLS]'s final hidden state and a 2-way classifier. Given
`next_sentence_label` [b] (an input of `data.mlm.next_sentence` samples), its loss, the
cross entropy averaged over the microbatch's sequences, joins the graph through `attach_loss`
on the logits, weighted like MoE's balancing losses (`aux_loss_scale`, set each step by the
objective to the loss scale over the microbatches): so the objective is the masked-LM token mean
plus the next-sentence sequence mean over the global batch, as Megatron's BERT, while the
reported loss stays the masked-LM one. The last forward's 2-way logits are kept on the head
(`last_logits`, [b, 2]) for inspection.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel_state as ps
from engine.models.language_model import LanguageModel
from engine.parallel_placement import set_placement
from engine.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    gather_from_sequence_parallel_region,
    mark_sequence_parallel,
)
from engine.transformer.attention import SelfAttention
from engine.transformer.config import TransformerConfig
from engine.transformer.dropout import dropout
from engine.transformer.loss_attach import attach_loss
from engine.transformer.mlp import MLP
from engine.transformer.norm import build_norm

_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.")


class BertLayer(nn.Module):
    """Post-LayerNorm: x = LN(x + drop(attn(x))); x = LN(x + drop(mlp(x)))."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.self_attention = SelfAttention(config)
        self.post_attention_layernorm = build_norm(config)
        self.mlp = MLP(config)
        self.post_mlp_layernorm = build_norm(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        c = self.config
        y = self.self_attention(x, None, mask)
        x = self.post_attention_layernorm(x + dropout(y, c.hidden_dropout, self.training, c.sequence_parallel))
        y = self.mlp(x)
        return self.post_mlp_layernorm(x + dropout(y, c.hidden_dropout, self.training, c.sequence_parallel))


class BertEncoder(nn.Module):
    """A pipeline stage's share of the layers; `recompute == "full"` keeps only each layer's input."""

    def __init__(self, config: TransformerConfig, num_layers: int):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(num_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        full = self.config.recompute == "full"
        for layer in self.layers:
            x = checkpoint(layer, x, mask) if full else layer(x, mask)
        return x


class BertModel(LanguageModel):
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
        sp = c.sequence_parallel
        self.embedding = self.position_embeddings = self.tokentype_embeddings = self.embedding_layernorm = None
        if pre_process:
            self.embedding = VocabParallelEmbedding(
                c.padded_vocab_size, c.hidden_size, sequence_parallel=sp, params_dtype=c.params_dtype,
                init_std=c.init_method_std,
            )  # fmt: skip
            set_placement(self.embedding.weight, tied_embedding=tie_across_stages)
            self.position_embeddings = nn.Embedding(c.seq_length, c.hidden_size, dtype=c.params_dtype)
            self.tokentype_embeddings = nn.Embedding(max(c.type_vocab_size, 1), c.hidden_size, dtype=c.params_dtype)
            for table in (self.position_embeddings, self.tokentype_embeddings):
                set_placement(table.weight, init_std=c.init_method_std)
                # Under SP each rank adds only its chunk's rows: the grad is a partial sum over TP.
                mark_sequence_parallel(table, sp)
            self.embedding_layernorm = build_norm(c)
        count = c.num_layers if num_layers is None else num_layers
        self.encoder = BertEncoder(c, count)
        self.lm_head = self.output_layer = self.binary_head = None
        if post_process and c.bert_binary_head:
            self.binary_head = BertBinaryHead(c)
        if post_process:
            self.lm_head = BertLMHead(c)
            self.output_layer = ColumnParallelLinear(
                c.hidden_size, c.padded_vocab_size, bias=True, sequence_parallel=sp, params_dtype=c.params_dtype,
                init_std=c.init_method_std, skip_weight_param_allocation=c.tie_embeddings and pre_process,
            )  # fmt: skip
            if tie_across_stages:
                set_placement(self.output_layer.weight, tied_embedding=True, tied_copy=True)

    @property
    def decoder(self) -> BertEncoder:
        """The layer stack under GPTModel's name (engine/compile.py compiles its layers)."""
        return self.encoder

    def fsdp_units(self) -> list[nn.Module]:
        """One unit per layer; embeddings and the MLM head form the model's own unit."""
        return list(self.encoder.layers)

    def global_param_name(self, name: str) -> str:
        """Layer numbers global; the last stage's tied decoder weight is the embedding."""
        m = _LAYER.match(name)
        if m:
            return f"encoder.layers.{int(m.group(1)) + self.layer_offset}.{name[m.end() :]}"
        if name == "output_layer.weight" and self.config.tie_embeddings:
            return "embedding.weight"
        return name

    def _sequence_chunk(self, t: torch.Tensor) -> torch.Tensor:
        """[s, ...] -> this TP rank's sequence chunk under SP (the rows its activations hold)."""
        if not self.config.sequence_parallel:
            return t
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        chunk = t.shape[0] // tp
        return t[rank * chunk : (rank + 1) * chunk]

    def _embed(self, ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """ids [b, s] -> LN(word + position + token type) [s, b, h] (a sequence chunk under SP)."""
        s = ids.shape[1]
        x = self.embedding(ids.t())
        positions = self._sequence_chunk(torch.arange(s, device=ids.device))
        x = x + self.position_embeddings(positions).unsqueeze(1)
        types = torch.zeros_like(ids) if token_type_ids is None else token_type_ids
        x = x + self.tokentype_embeddings(self._sequence_chunk(types.t()))
        x = self.embedding_layernorm(x)
        return dropout(x, self.config.hidden_dropout, self.training, self.config.sequence_parallel)

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        packed_seq_params=None,
        mtp_labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """First stage: token ids [b, s]; later stages: hidden states [s, b, h] (a sequence chunk
        under SP). Last stage: per-token MLM loss [b, s] when labels are given (the target at
        each position, IGNORE_INDEX where none), else this rank's vocabulary slice of the logits
        [b, s, vocab/tp]; other stages return hidden states. `attention_mask` [b, s]: 1 on real
        tokens (None: all). `next_sentence_label` [b] (last stage, with the binary head): 1 where the
        second segment is a random one; its loss is attached to the logits. Packed rows and MTP
        do not exist for BERT (the job spec refuses them)."""
        if packed_seq_params is not None or mtp_labels is not None:
            raise ValueError("arch bert takes no packed rows or multi-token prediction labels")
        if self.pre_process:
            b = x.shape[0]
            x = self._embed(x, token_type_ids)
        else:
            b = x.shape[1]
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(device=x.device, dtype=torch.bool).view(b, 1, 1, -1)
        else:  # everything attends to everything (None would mean causal to SelfAttention)
            seq = x.shape[0] * (ps.get_tensor_model_parallel_world_size() if self.config.sequence_parallel else 1)
            mask = torch.ones(b, 1, 1, seq, dtype=torch.bool, device=x.device)
        x = self.encoder(x, mask)
        if not self.post_process:
            return x
        logits = self._logits(x)
        if self.binary_head is not None:
            binary = self.binary_head(x)
            if next_sentence_label is not None:
                loss = F.cross_entropy(binary.float(), next_sentence_label.to(binary.device))
                logits = attach_loss(logits, loss, self.binary_head.aux_loss_scale)
        return self._loss_or_logits(logits, labels)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> this rank's vocabulary slice of the MLM logits [s, b, vocab/tp]."""
        tied_here = self.config.tie_embeddings and self.pre_process
        h = self.lm_head(x)
        return self._mask_vocab_padding(self.output_layer(h, weight=self.embedding.weight if tied_here else None))


class BertLMHead(nn.Module):
    """transformers' BertPredictionHeadTransform: dense (replicated over TP: it works on this
    rank's sequence chunk under SP, so its grad is a partial sum there), GELU, LayerNorm."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=config.params_dtype)
        set_placement(self.dense.weight, init_std=config.init_method_std)
        set_placement(self.dense.bias, init_std=0.0)
        mark_sequence_parallel(self.dense, config.sequence_parallel)
        self.layernorm = build_norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layernorm(F.gelu(self.dense(x)))


class BertBinaryHead(nn.Module):
    """Pooler (dense + tanh on [CLS]) and the 2-way classifier, replicated over TP: under SP the
    sequence is gathered first (its gradient split back, the head being the same on every TP
    rank), so every TP rank computes the same [b, 2] logits and the same parameter gradients."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        h = config.hidden_size
        self.pooler = nn.Linear(h, h, dtype=config.params_dtype)
        self.classifier = nn.Linear(h, 2, dtype=config.params_dtype)
        for layer in (self.pooler, self.classifier):
            set_placement(layer.weight, init_std=config.init_method_std)
            set_placement(layer.bias, init_std=0.0)
        self.sequence_parallel = config.sequence_parallel
        self.aux_loss_scale = 1.0  # the objective's weight for the attached loss (engine/objective.py)
        self.last_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] (a sequence chunk under SP) -> [b, 2]."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        logits = self.classifier(torch.tanh(self.pooler(x[0])))
        self.last_logits = logits.detach()
        return logits
