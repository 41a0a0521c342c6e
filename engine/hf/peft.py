"""LoRA adapters in Hugging Face PEFT's format: names, adapter_config.json, and the folder.

A PEFT LoRA folder holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors
are named `base_model.model.<the HF module>.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]). Our adapters are one (A, B) per Hugging Face projection already
(engine/transformer/lora.py), in HF's row order, so the mapping is names only:

    decoder.layers.3.self_attention.linear_qkv.lora.A.q_proj
      <-> base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight

Llama-layout families only (Llama, Mistral, Qwen2/3): GPT-2 fuses q, k and v into one Conv1D
(c_attn), which PEFT adapts as one projection, and MoE / MLA models refuse LoRA in the job spec.
Used by `elastron export --format peft` (engine/hf/exporter.py) and `model.lora.init_from`
(`load_adapters`, every rank its own shards). No peft import: the format is plain JSON and
safetensors, and peft stays a test-only dependency.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine import parallel_state as ps
from engine.jobspec.lora import HF_MODULES, LoRASpec
from engine.parallel_placement import placement_of
from engine.tensor_parallel import shard_of
from engine.transformer.lora import adapter_params

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_OURS = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_\w+)\.lora\.([AB])\.(\w+)$")
_PEFT = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_BLOCK = {"self_attention": "self_attn", "mlp": "mlp"}


class PeftFormatError(ValueError):
    """An adapter folder this job cannot use; the message names the file and the field."""


def peft_name(ours: str) -> str:
    """Our adapter's global name -> its tensor name in adapter_model.safetensors."""
    m = _OURS.match(ours)
    if m is None:
        raise KeyError(f"{ours} is not a LoRA adapter of a decoder layer")
    layer, block, _, which, proj = m.groups()
    return f"base_model.model.model.layers.{layer}.{_BLOCK[block]}.{proj}.lora_{which}.weight"


def our_name(peft: str) -> str:
    """The inverse of peft_name; KeyError for a tensor that is not a decoder layer's LoRA A/B."""
    m = _PEFT.match(peft)
    if m is None or m.group(3) not in HF_MODULES:
        raise KeyError(f"{peft} is not a LoRA adapter of a Llama-family projection")
    layer, block, proj, which = m.groups()
    ours_block = "self_attention" if block == "self_attn" else "mlp"
    return f"decoder.layers.{layer}.{ours_block}.{HF_MODULES[proj]}.lora.{which}.{proj}"


def adapter_config(lora: LoRASpec, projections: Sequence[str], base: str | None) -> dict[str, Any]:
    """adapter_config.json for these adapters (PEFT's LoraConfig fields; what we leave out takes
    PEFT's defaults, which are what our adapters do)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(projections),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True if lora.init == "kaiming" else "gaussian",
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """Our whole adapters (global names) -> a PEFT folder; returns it."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file({peft_name(k): v.contiguous() for k, v in sorted(tensors.items())}, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def read_adapter(folder: str | Path, lora: LoRASpec, projections: Sequence[str]) -> dict[str, torch.Tensor]:
    """A PEFT folder's adapters by our global names, after checking its config is this job's
    (r, lora_alpha, target_modules; no DoRA, rsLoRA or biases)."""
    import os

    from safetensors.torch import load as load_bytes

    from engine.checkpointing.backends import open_storage

    where = str(folder).rstrip("/")
    storage = open_storage(os.path.expanduser(where))
    try:
        config = json.loads(storage.get_bytes(CONFIG_FILE))
    except (OSError, ValueError, KeyError) as e:
        raise PeftFormatError(f"model.lora.init_from: cannot read {where}/{CONFIG_FILE}: {e}") from e
    want = {
        "peft_type": "LORA",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "use_dora": False,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "bias": "none",
    }
    for key, value in want.items():
        got = config.get(key, {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none"}.get(key))
        if got != value and not (isinstance(value, float) and isinstance(got, int | float) and float(got) == value):
            raise PeftFormatError(
                f"model.lora.init_from: {where}/{CONFIG_FILE} has {key} {got!r}, this job's is {value!r}: "
                f"set model.lora to match the adapter"
            )
    targets = config.get("target_modules")
    targets = sorted(targets) if isinstance(targets, list) else targets
    if targets != sorted(projections):
        raise PeftFormatError(
            f"model.lora.init_from: {where}/{CONFIG_FILE} targets {targets!r}, this job's model.lora.target_modules "
            f"give {sorted(projections)!r}: set them to match the adapter"
        )
    try:
        raw = load_bytes(storage.get_bytes(WEIGHTS_FILE))
    except (OSError, ValueError, KeyError) as e:
        raise PeftFormatError(f"model.lora.init_from: cannot read {where}/{WEIGHTS_FILE}: {e}") from e
    out = {}
    for name, tensor in raw.items():
        key = name.replace(".default.", ".")  # a folder saved with the adapter's name in its keys
        try:
            out[our_name(key)] = tensor
        except KeyError as e:
            raise PeftFormatError(f"model.lora.init_from: {where}/{WEIGHTS_FILE}: {e.args[0]}") from e
    return out


@torch.no_grad()
def load_adapters(chunks: Sequence[nn.Module], tensors: dict[str, torch.Tensor], where: str) -> None:
    """Every adapter of `chunks` from `tensors` (whole, by global name): this rank's shard of each.
    A missing adapter, or one of another shape, fails naming both."""
    world, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for chunk in chunks:
        for name, p in adapter_params(chunk):
            if name not in tensors:
                raise PeftFormatError(f"model.lora.init_from: {where} has no {peft_name(name)} (our {name})")
            full, pl = tensors[name], placement_of(p)
            if tuple(full.shape) != tuple(pl.shape):
                raise PeftFormatError(
                    f"model.lora.init_from: {where}: {peft_name(name)} is {tuple(full.shape)}, this model's is "
                    f"{tuple(pl.shape)}"
                )
            p.copy_(shard_of(full, pl.tp_dim, pl.tp_stride, rank, world).to(p.dtype))
