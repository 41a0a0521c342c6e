"""The Hugging Face families this engine runs: one row each, the only list of them.

A family is a config.json `architectures[0]`. What differs between families is data, read here
by every place that names one: the config.json -> `model` fields map (hf_fields.py), the
`model` -> config.json map of `elastron export` (hf_export_config.py), and the tensor-name
tables of import and export (engine/hf/families.py). Adding a family is a row here plus, for a
new `layout`, its field map and tensor table.

Plain data, no torch: the API validates jobs with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


class HFConfigError(ValueError):
    """A config.json this engine cannot run; the message names the config field."""


@dataclass(frozen=True)
class HFFamily:
    architecture: str  # config.json architectures[0]
    model_type: str  # config.json model_type
    arch: Literal["llama", "gpt2", "bert", "t5"]  # our model.arch
    # How its config.json fields and tensors are named: Llama's (and its derivatives'), GPT-2's
    # (Conv1D linears, fused c_attn) or DeepSeek-V3's (multi-latent attention, MTP layers).
    layout: Literal["llama", "gpt2", "deepseek", "bert", "t5"]
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2)
    qk_layernorm: bool = False  # per-head q/k norms (Qwen3)
    # How its experts are configured and named: Mixtral's block_sparse_moe with w1/w2/w3,
    # Qwen3-MoE's mlp.experts (sparse step, mlp_only_layers), DeepSeek-V3's routed + shared.
    moe: Literal["mixtral", "qwen3_moe", "deepseek"] | None = None
    # Another family's tensors and settings (Mistral's sliding window covers the whole sequence
    # whenever it imports): exported as itself only when the job was imported from it.
    same_as: str | None = None
    # config.json flags the exporter writes for this family (transformers' defaults differ).
    export_flags: dict[str, Any] = field(default_factory=dict)
    binary_head: bool = False  # BERT with its next-sentence head (model.bert_binary_head)


# Qwen2-MoE is left out: its shared expert has a sigmoid gate our MoE does not have.
FAMILIES: dict[str, HFFamily] = {
    f.architecture: f
    for f in (
        HFFamily(
            "LlamaForCausalLM", "llama", "llama", "llama",
            export_flags={"attention_bias": False, "mlp_bias": False},
        ),
        HFFamily("MistralForCausalLM", "mistral", "llama", "llama", same_as="LlamaForCausalLM"),
        HFFamily("Qwen2ForCausalLM", "qwen2", "llama", "llama", qkv_bias=True),
        HFFamily(
            "Qwen3ForCausalLM", "qwen3", "llama", "llama", qk_layernorm=True,
            export_flags={"attention_bias": False},
        ),
        HFFamily("MixtralForCausalLM", "mixtral", "llama", "llama", moe="mixtral"),
        HFFamily(
            "Qwen3MoeForCausalLM", "qwen3_moe", "llama", "llama", qk_layernorm=True, moe="qwen3_moe",
            export_flags={"attention_bias": False},
        ),
        HFFamily("GPT2LMHeadModel", "gpt2", "gpt2", "gpt2"),
        HFFamily("DeepseekV3ForCausalLM", "deepseek_v3", "llama", "deepseek", moe="deepseek"),
        HFFamily("BertForMaskedLM", "bert", "bert", "bert"),  # engine/jobspec/hf_bert.py, engine/hf/bert_tensors.py
        HFFamily("BertForPreTraining", "bert", "bert", "bert", binary_head=True),
        HFFamily("T5ForConditionalGeneration", "t5", "t5", "t5"),  # engine/jobspec/hf_t5.py, engine/hf/t5.py
    )
}  # fmt: skip


def family(architecture: str) -> HFFamily:
    """The family of a config.json's `architectures[0]`; KeyError for one not in the registry."""
    return FAMILIES[architecture]


def family_with(
    layout: str, *, qkv_bias: bool = False, qk_layernorm: bool = False, moe: str | None = None, binary_head: bool = False
) -> HFFamily:
    """The family a model of these traits exports as (families that are another's alias are not
    candidates); KeyError when none has them."""
    for f in FAMILIES.values():
        if f.same_as is None and (f.layout, f.qkv_bias, f.qk_layernorm, f.moe, f.binary_head) == (
            layout,
            qkv_bias,
            qk_layernorm,
            moe,
            binary_head,
        ):
            return f
    raise KeyError((layout, qkv_bias, qk_layernorm, moe, binary_head))
