"""`model.t5` and the rules of a T5 job (`model.arch: t5`).

T5 (v1.1 style, as transformers' T5 with an LM head) is an encoder-decoder: the
encoder stack reads `tokens`, the decoder stack reads the shifted targets (the source's
`decoder_input_ids`) and attends to the encoder's output. What only T5 has lives in this
section; the shared `model` fields keep their meaning (num_layers: encoder layers,
hidden_size: d_model, kv_channels: d_kv, ffn_hidden_size: d_ff, norm_epsilon:
layer_norm_epsilon, tie_embeddings: the LM head is the shared embedding).

What a T5 job cannot do (yet) is refused here, each rule with its fix, so the API refuses it at
submission rather than a rank at start.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from engine.jobspec.common import NonNegativeInt, PositiveInt, _Section

# The data sources a T5 model trains on (engine/data/span_corruption.py, engine/data/seq2seq.py).
T5_SOURCES = ("span_corruption", "seq2seq")


class T5Spec(_Section):
    """T5's own sizes (transformers' T5Config names where they differ from Megatron-Core's)."""

    num_decoder_layers: PositiveInt | None = Field(None, description="Decoder layers; default: model.num_layers.")
    relative_attention_num_buckets: PositiveInt = Field(
        32, description="Relative position buckets (half per direction in the bidirectional encoder)."
    )
    relative_attention_max_distance: PositiveInt = Field(
        128, description="Distances at or beyond this share the last bucket."
    )
    scale_decoder_outputs: bool | None = Field(
        None,
        description="Multiply the decoder's output by hidden_size**-0.5 before the LM head (original T5 "
        "with a tied head; transformers' scale_decoder_outputs). Default: model.tie_embeddings.",
    )
    decoder_start_token_id: NonNegativeInt = Field(
        0, description="The decoder's first input id (T5: the pad id, 0)."
    )

    def filled(self, num_layers: int, tie_embeddings: bool) -> T5Spec:
        """This section with its defaults resolved against the model's other fields."""
        return self.model_copy(
            update={
                "num_decoder_layers": self.num_decoder_layers or num_layers,
                "scale_decoder_outputs": (
                    tie_embeddings if self.scale_decoder_outputs is None else self.scale_decoder_outputs
                ),
            }
        )


def check_t5_model(m: Any) -> None:
    """ModelSpec rules for arch t5 (features of the decoder-only families T5 does not have), and
    the t5 section only with arch t5."""
    if m.arch != "t5":
        if m.t5 is not None:
            raise ValueError(f"model.t5 applies to model.arch t5 only (this model is {m.arch}): remove it")
        return
    refused = {
        "model.moe": m.moe is not None,
        "model.attention: mla": m.attention == "mla",
        "model.mtp_num_layers": bool(m.mtp_num_layers),
        "model.qk_layernorm": m.qk_layernorm,
        "model.qkv_bias": bool(m.qkv_bias),
        "model.rope_scaling": m.rope_scaling is not None,
        "model.lora": m.lora is not None,
    }
    for field, bad in refused.items():
        if bad:
            raise ValueError(f"{field} is not available with model.arch t5: remove it")
    if m.num_query_groups != m.num_attention_heads:
        raise ValueError(
            f"model.num_query_groups ({m.num_query_groups}) must equal model.num_attention_heads "
            f"({m.num_attention_heads}) for model.arch t5 (multi-head attention): remove it"
        )
    if m.activation != "gelu_tanh":
        raise ValueError(
            f"model.activation {m.activation!r}: model.arch t5 has T5 v1.1's gated-GELU feed-forward "
            "(gelu_tanh, transformers' gelu_new): remove model.activation or set it to gelu_tanh"
        )


def check_t5_job(spec: Any) -> None:
    """Cross-section rules of a T5 job, and the T5 data sources refused to the other families."""
    m, p, d, t = spec.model, spec.parallel, spec.data, spec.training
    if m.arch != "t5":
        if d.source in T5_SOURCES:
            raise ValueError(
                f"data.source {d.source} makes encoder-decoder samples: it needs model.arch t5 (this model is "
                f"{m.arch}); use text, indexed, blend or sft"
            )
        return
    if d.source not in T5_SOURCES:
        raise ValueError(
            f"data.source {d.source}: model.arch t5 trains on encoder-decoder samples: use data.source "
            "span_corruption (T5's pretraining objective over a text file) or seq2seq (input -> target pairs, "
            "JSON lines)"
        )
    if p.pipeline > 2 or p.virtual_pipeline is not None or p.pipeline_layers is not None:
        raise ValueError(
            "parallel.pipeline: model.arch t5 splits into two stages only, the encoder on the first and the "
            "decoder on the second (Megatron-Core's pipeline split rank): use parallel.pipeline 1 or 2 without "
            "parallel.virtual_pipeline and parallel.pipeline_layers"
        )
    if p.context > 1:
        raise ValueError(
            "parallel.context: context parallelism is not available with model.arch t5 (relative position "
            "bias and cross-attention over whole sequences): set parallel.context: 1"
        )
    if t.compile:
        raise ValueError("training.compile is not available with model.arch t5 yet: set training.compile: false")
    if t.fp8:
        raise ValueError("training.fp8 is not available with model.arch t5 yet: set training.fp8: false")
