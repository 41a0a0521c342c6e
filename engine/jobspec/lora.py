"""`model.lora`: low-rank adapters (LoRA) on the transformer layers' linears, PEFT's way.

Each targeted projection W (out x in) gains two small matrices, A (rank x in) and B (out x
rank), and computes W x + (alpha / rank) B A dropout(x); only A and B train (the base weights are
frozen: no gradients, no optimizer state, no gradient reduction). B starts at zero, so training
starts from the base model exactly; A is drawn as PEFT draws it (`kaiming`: uniform(+-1/sqrt(in)),
PEFT's `init_lora_weights=True`; `gaussian`: normal(0, 1/rank)).

`target_modules` takes our module names and the Hugging Face (Llama-family) names people write in
PEFT configs; both map to the same projections:

| ours | Hugging Face |
|---|---|
| `linear_qkv` | `q_proj`, `k_proj`, `v_proj` |
| `linear_proj` | `o_proj` |
| `linear_fc1` | `gate_proj`, `up_proj` (a non-gated MLP has `up_proj` only) |
| `linear_fc2` | `down_proj` |

Our fused projections keep one adapter per Hugging Face projection (an adapter on `q_proj`
alone touches only the query rows of `linear_qkv`), so a PEFT adapter comes in and goes out
unchanged. Pure pydantic: the engine's module is engine/transformer/lora.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.jobspec.common import _Section

# Our module -> the Hugging Face projections it fuses, in the order of its output rows.
OUR_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
HF_MODULES: dict[str, str] = {hf: ours for ours, hfs in OUR_MODULES.items() for hf in hfs}
KNOWN = (*OUR_MODULES, *HF_MODULES)


class LoRASpec(_Section):
    """Low-rank adapters on the decoder layers' projections (see the module docstring)."""

    rank: int = Field(8, ge=1, le=4096, strict=True, description="The adapters' rank r (PEFT's r).")
    alpha: float = Field(
        16.0, gt=0.0, description="Scale: the update is alpha / rank x B A x (PEFT's lora_alpha)."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input (PEFT's lora_dropout).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        min_length=1,
        description="Projections that get adapters: ours (linear_qkv, linear_proj, linear_fc1, linear_fc2) or "
        "Hugging Face names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj). Default: "
        "q_proj and v_proj, as PEFT's for Llama.",
    )
    init: Literal["kaiming", "gaussian"] = Field(
        "kaiming",
        description="A's initialisation (B is zeros): kaiming = uniform(+-1/sqrt(in)), PEFT's default; "
        "gaussian = normal(0, 1/rank).",
    )
    init_from: str | None = Field(
        None,
        description="A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, local or "
        "s3://) to start the adapters from instead of initialising them; its r, lora_alpha and "
        "target_modules must equal these.",
    )

    @model_validator(mode="after")
    def _check(self) -> LoRASpec:
        unknown = [t for t in self.target_modules if t not in KNOWN]
        if unknown:
            raise ValueError(
                f"model.lora.target_modules: unknown module {unknown[0]!r}: use {', '.join(OUR_MODULES)} or "
                f"{', '.join(HF_MODULES)}"
            )
        return self

    def projections(self, gated: bool) -> tuple[str, ...]:
        """The Hugging Face projections that get adapters, in a fixed order (ours expanded)."""
        wanted: set[str] = set()
        for t in self.target_modules:
            if t == "linear_fc1" and not gated:
                wanted.add("up_proj")  # a non-gated MLP's fc1 is one projection
            else:
                wanted.update(OUR_MODULES.get(t, (t,)))
        return tuple(hf for hf in HF_MODULES if hf in wanted)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank
