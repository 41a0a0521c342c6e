"""What every model family shares: the interface the engine builds, shards, checkpoints and
trains a model through, and the vocabulary-parallel output they all end in.

A family (engine/models/gpt.py, bert.py, t5.py) is built once per pipeline stage it holds:
`pre_process` (the stage with the embeddings), `post_process` (the stage with the output layer),
and for layer-split families the stage's `layer_offset` and `num_layers`. The engine then asks
it for `fsdp_units()` (what data-parallel sharding gathers at once), `global_param_name(name)`
(a parameter's name in the unsplit model: checkpoints and Hugging Face mapping use it) and `mtp`
(its multi-token prediction depths, or None). Its last stage computes this rank's vocabulary
slice of the logits, masks the padded vocabulary and returns the logits or the per-token loss,
the same way for every family (`_loss_or_logits`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine import parallel_state as ps
from engine.tensor_parallel import vocab_parallel_cross_entropy
from engine.transformer.config import TransformerConfig


class LanguageModel(nn.Module):
    # Whether pipeline stages split this family's layers (`layer_offset`, `num_layers`); False for
    # a family whose stages are whole stacks of their own (T5: encoder | decoder).
    splits_layers_over_stages = True

    def __init__(self, config: TransformerConfig, *, pre_process: bool, post_process: bool, layer_offset: int = 0):
        super().__init__()
        self.config = config
        self.pre_process, self.post_process, self.layer_offset = pre_process, post_process, layer_offset
        self.mtp: nn.Module | None = None  # multi-token prediction depths (decoders that have them)

    def fsdp_units(self) -> list[nn.Module]:
        """What data-parallel parameter sharding gathers at once, in forward order; the
        parameters outside them form the model's own unit."""
        raise NotImplementedError

    def global_param_name(self, name: str) -> str:
        """The parameter's name in the whole (unsplit) model."""
        return name

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf for the padded vocabulary entries this rank's slice holds, in place: they are not
        tokens, so they get no probability mass (and the loss and logits match an unpadded model,
        e.g. a Hugging Face one, exactly)."""
        per = logits.shape[-1]
        first = self.config.true_vocab_size - ps.get_tensor_model_parallel_rank() * per  # first padded column here
        if first < per:
            logits[..., max(first, 0) :].fill_(float("-inf"))
        return logits

    @staticmethod
    def loss_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss [b, s] for the logits forward() returns. Those are a [b, s, vocab/tp]
        view of the contiguous [s, b, vocab/tp] tensor the model computes; the loss works on the
        contiguous one, so the (large) logits are never copied."""
        return vocab_parallel_cross_entropy(logits.transpose(0, 1), labels.t()).t()

    def _loss_or_logits(self, logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """What a last stage returns from its [s, b, vocab/tp] logits: the per-token loss [b, s]
        with `labels`, else the logits as [b, s, vocab/tp]."""
        if labels is None:
            return logits.transpose(0, 1)
        return self.loss_from_logits(logits.transpose(0, 1), labels)
