"""The encoder's job-spec rules: what `model.arch: bert` supports, and `data.mlm` (masked-LM
sampling: how many tokens to predict, how, and which ids are BERT's special tokens).

Plain pydantic, no torch: the API validates jobs with it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from engine.jobspec.common import _Section


def bert_defaults(m: Any) -> None:
    """arch bert's defaults (m: ModelSpec, before the generic ones): GELU, biases on every linear,
    the MLM decoder tied to the embedding, 2 token types, no next-sentence head."""
    defaults = {"activation": "gelu", "qkv_bias": True, "tie_embeddings": True, "type_vocab_size": 2}
    for name, value in {**defaults, "bert_binary_head": False}.items():
        if getattr(m, name) is None:
            setattr(m, name, value)


def check_bert_model(m: Any) -> None:
    """`model` settings a BERT encoder does not have, each refused with the fix (m: ModelSpec,
    its defaults filled in)."""
    refused = {
        "moe": m.moe is not None,
        "mla": m.attention == "mla",
        "mtp_num_layers": bool(m.mtp_num_layers),
        "lora": m.lora is not None,
        "qk_layernorm": m.qk_layernorm,
        "rope_scaling": m.rope_scaling is not None,
        "kv_channels": m.kv_channels not in (None, m.hidden_size // m.num_attention_heads),
    }
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"model.{name} is not supported with arch bert (a BERT encoder has none): remove it")
    if m.num_query_groups != m.num_attention_heads:
        raise ValueError(
            f"model.num_query_groups ({m.num_query_groups}) must equal model.num_attention_heads "
            f"({m.num_attention_heads}) for arch bert (plain multi-head attention)"
        )
    if m.activation == "swiglu" or not m.qkv_bias:
        raise ValueError("arch bert has GELU feed-forward layers and biases on every linear: drop model.activation "
                         "swiglu / model.qkv_bias false")


class MLMSpec(_Section):
    """Masked-LM samples (data.source: mlm): [CLS] tokens [SEP], a share of the tokens selected
    for prediction, of those 80 % replaced by [MASK], 10 % by a random token, 10 % kept."""

    corpus: Literal["text", "indexed"] = Field(
        "text",
        description="text: data.path is a UTF-8 file (default: the shipped corpus); indexed: data.path is the "
        "PREFIX written by `elastron preprocess`. Samples are windows across documents, as GPT's.",
    )
    mask_prob: float = Field(0.15, gt=0.0, lt=1.0, description="Each token (or word) is selected with this probability.")
    whole_word: bool = Field(
        False,
        description="Select whole words: a word's tokens are selected (and masked) together. Words: "
        "WordPiece '##' continuations, SentencePiece pieces without '\u2581', bytes between whitespace.",
    )
    next_sentence: bool = Field(
        False,
        description="Sentence pairs for model.bert_binary_head: [CLS] A [SEP] B [SEP], the window cut at a "
        "random token; half the time B is replaced by the start of another window (label 1, BERT's "
        "'random next'). Token types: 0 for [CLS] A [SEP], 1 for B [SEP].",
    )
    cls_id: int | None = Field(None, ge=0, description="[CLS]'s id; default: the tokenizer's [CLS] token.")
    sep_id: int | None = Field(None, ge=0, description="[SEP]'s id; default: the tokenizer's [SEP] token.")
    pad_id: int | None = Field(None, ge=0, description="[PAD]'s id; default: the tokenizer's [PAD] token.")
    mask_id: int | None = Field(None, ge=0, description="[MASK]'s id; default: the tokenizer's [MASK] token.")

    @model_validator(mode="after")
    def _distinct(self) -> MLMSpec:
        given = {k: v for k in ("cls_id", "sep_id", "pad_id", "mask_id") if (v := getattr(self, k)) is not None}
        if len(set(given.values())) != len(given):
            raise ValueError(f"data.mlm: the special token ids must differ, got {given}")
        return self


def check_bert_job(model: Any, parallel: Any, data: Any) -> None:
    """Across sections: a bidirectional encoder learns from masked-LM samples (next-token labels
    would be visible to it), masked-LM samples train an encoder, and context parallelism (a
    causal ring attention) is not built for it."""
    if model.arch == "bert" and data.source not in ("mlm", "synthetic"):
        raise ValueError(
            f"data.source {data.source} gives next-token labels, which a bidirectional encoder sees in its input: "
            "arch bert trains on data.source: mlm"
        )
    if data.source == "mlm" and model.arch != "bert":
        raise ValueError(f"data.source mlm makes masked-LM samples for arch bert, not {model.arch}: set model.arch: bert")
    if model.arch == "bert" and parallel.context > 1:
        raise ValueError(
            "parallel.context > 1 is not supported with arch bert (context-parallel attention is causal, "
            "BERT's is bidirectional with a padding mask): set parallel.context: 1"
        )
    if data.source == "mlm" and model.seq_length < 5:
        raise ValueError(f"model.seq_length ({model.seq_length}) is too short for [CLS] A [SEP] B [SEP]: use at least 5")
    if data.source == "mlm" and bool(model.bert_binary_head) != data.mlm.next_sentence:
        raise ValueError(
            "model.bert_binary_head and data.mlm.next_sentence go together (the head learns from the sentence "
            "pairs' labels): set both or neither"
        )
