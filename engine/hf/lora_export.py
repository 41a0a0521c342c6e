"""Exporting a LoRA job's checkpoint: the adapters as a PEFT folder, or merged into the base.

A LoRA checkpoint holds adapters only (engine/transformer/lora.py), so:
- `elastron export CKPT --format peft` writes them as PEFT's `adapter_config.json` +
  `adapter_model.safetensors` (engine/hf/peft.py), which `peft.PeftModel.from_pretrained(base,
  DIR)` loads onto the job's `model.init_from`;
- `--format hf --merge-lora` reads the base's Hugging Face tensors from `model.init_from` (whole,
  one at a time) and adds each adapter's update, W + alpha/r x B A, to the projection it sits on
  (in fp32, then cast to --dtype): a plain Hugging Face model with the adapters folded in.
A random base (no init_from) is not in the checkpoint and is not exported.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from engine.checkpointing.backends import open_storage
from engine.hf.peft import CONFIG_FILE, WEIGHTS_FILE, adapter_config, peft_name, write_adapter
from engine.jobspec import JobSpec
from engine.jobspec.hf_config import read_hf_config
from engine.jobspec.hf_families import family
from engine.transformer.activations import is_gated

_PREFIX = "base_model.model."


class LoRAExportError(ValueError):
    """A LoRA export that cannot be made; the message says why and what to do instead."""


def check_exportable(spec: JobSpec, what: str) -> None:
    """The job trained adapters on a Llama-layout Hugging Face base (what PEFT's names describe)."""
    if spec.model.lora is None:
        raise LoRAExportError(f"{what}: this checkpoint has no LoRA adapters (its job has no model.lora): use --format hf")
    if spec.model.init_from is None:
        raise LoRAExportError(
            f"{what}: the job trained its adapters on a random base (no model.init_from), which the checkpoint "
            "does not hold: export LoRA jobs that start from a Hugging Face model"
        )
    arch = (read_hf_config(spec.model.init_from).get("architectures") or ["?"])[0]
    try:
        layout = family(arch).layout
    except KeyError:
        layout = None
    if layout != "llama":
        raise LoRAExportError(f"{what}: PEFT names exist for Llama-layout families only, not {arch}")


def export_peft(
    spec: JobSpec,
    ours: dict[str, torch.Tensor],
    output: str,
    *,
    dtype: torch.dtype,
    endpoint_url: str | None = None,
    region: str | None = None,
) -> tuple[list[str], int]:
    """The checkpoint's adapters (`ours`: whole, by global name) as a PEFT folder at `output`
    (local or s3://; the config is written last). Returns (files, bytes of tensors)."""
    check_exportable(spec, "--format peft")
    lora = spec.model.lora
    adapters = {k: v.to(dtype) for k, v in ours.items() if ".lora." in k}
    projections = lora.projections(is_gated(spec.model.activation))
    config = adapter_config(lora, projections, spec.model.init_from)
    with tempfile.TemporaryDirectory(prefix="elastron-export-") as tmp:
        write_adapter(tmp, adapters, config)
        storage = open_storage(output, endpoint_url=endpoint_url, region=region)
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            storage.put_file(Path(tmp) / name, name)
    return [CONFIG_FILE, WEIGHTS_FILE], sum(t.numel() * t.element_size() for t in adapters.values())


@torch.no_grad()
def merged_hf_tensors(spec: JobSpec, ours: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """model.init_from's tensors with every adapter's update added, cast to `dtype`."""
    from engine.hf.reader import HFFolder

    check_exportable(spec, "--merge-lora")
    scaling = spec.model.lora.scaling
    folder = HFFolder(spec.model.init_from)
    updates: dict[str, torch.Tensor] = {}
    for name, a in ours.items():
        if ".lora.A." not in name:
            continue
        b = ours[name.replace(".lora.A.", ".lora.B.")]
        target = peft_name(name).removeprefix(_PREFIX).replace(".lora_A.weight", ".weight")
        updates[target] = (b.double() @ a.double() * scaling).float()
    out = {}
    for name in folder.tensors:
        t = folder.read(name, slice(None))
        if name in updates:  # in fp32 whatever the base's dtype; rounded once, to the export's
            t = t.float() + updates.pop(name)
        out[name] = t.to(dtype).contiguous()
    if updates:
        raise LoRAExportError(f"--merge-lora: {spec.model.init_from} has no {sorted(updates)[0]} to merge an adapter into")
    return out
