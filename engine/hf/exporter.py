"""`elastron export CHECKPOINT --format hf`: a committed elastron checkpoint -> a Hugging Face folder.

One process, no process group: DCP reads every model tensor whole (whatever layout saved it:
its metadata records each shard's global offset), families.hf_tensors cuts our fused tensors
back into HF's and drops the vocabulary padding, and the folder gets config.json (the job's
model, over the config.json it was imported from when there was one), generation_config.json,
safetensors shards of at most `max_shard_bytes` with their index, and the tokenizer files of an
`hf:` tokenizer. Optimizer state is not read. An `s3://` output is written locally first and
uploaded file by file, the index last, so a reader never sees an index naming missing shards.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from engine.checkpointing import raw_io
from engine.checkpointing.backends import open_storage
from engine.checkpointing.commit import open_checkpoint, resolve_checkpoint
from engine.data.tokenizer import build_tokenizer, local_tokenizer_path
from engine.hf.families import hf_tensors
from engine.hf.segment import Shapes
from engine.jobspec import JobSpec, parse_job, parse_tokenizer_spec
from engine.jobspec.hf_config import HFConfigError, read_hf_config
from engine.jobspec.hf_export_config import hf_config_for
from engine.jobspec.layout import split_checkpoint_uri
from engine.transformer.config import TransformerConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_SHARD_BYTES = 5 * 10**9  # the Hub's default max_shard_size ("5GB")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message says why and what to do."""


@dataclass(frozen=True)
class ExportReport:
    iteration: int
    tensors: int
    bytes_written: int
    files: list[str]
    seconds: float


def read_model_tensors(uri: str, *, endpoint_url: str | None = None, region: str | None = None):
    """(iteration, the job spec it was saved by, {global name: full tensor}) of the committed
    checkpoint `uri`: a job's checkpoint root (its newest) or one `iter_NNNNNNN` folder."""
    root_uri, key = split_checkpoint_uri(uri)
    storage = open_storage(root_uri, endpoint_url=endpoint_url, region=region)
    found = resolve_checkpoint(storage, key)
    if found is None:
        raise ExportError(f"no committed checkpoint at {uri}")
    job_root, iteration = found
    with tempfile.TemporaryDirectory(prefix="elastron-export-") as cache:
        opened = open_checkpoint(storage, job_root, iteration, Path(cache), check_now=[raw_io.METADATA])
        metadata = raw_io.RawStorageReader(opened).read_metadata()
        wanted = {
            k: md
            for k, md in metadata.state_dict_metadata.items()
            if k.startswith("model/") and isinstance(md, TensorStorageMetadata)
        }
        for k, md in wanted.items():  # whole tensors only, and nothing allocated the files do not hold
            if sum(c.sizes.numel() for c in md.chunks) != md.size.numel():
                raise ExportError(f"checkpoint {uri}: its chunks of {k} do not make up the whole {list(md.size)} tensor")
        stored = sum(int(e["size"]) for e in opened.files)
        if sum(md.size.numel() * md.properties.dtype.itemsize for md in wanted.values()) > stored:
            raise ExportError(f"checkpoint {uri}: its metadata names more tensor bytes than its {stored} stored bytes")
        targets = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in wanted.items()}
        with warnings.catch_warnings():  # one process, no process group: exactly the intent
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            raw_io.load(targets, opened)
    # parse_job: a record saved before specs carried hf_config_digest reads config.json once
    spec = parse_job(opened.meta["job"]) if opened.meta.get("job") else None
    if spec is None:
        raise ExportError(
            f"checkpoint {uri} carries no job record (saved by an older elastron): cannot tell its model"
        )
    return iteration, spec, _join_strided(targets)


def export_peft(
    checkpoint: str, output: str, *, dtype: str = "fp32", endpoint_url: str | None = None, region: str | None = None
) -> ExportReport:
    """Write a LoRA checkpoint's adapters to `output` as a PEFT folder (engine/hf/lora_export.py)."""
    from engine.hf.lora_export import export_peft as write_peft

    start = time.perf_counter()
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    iteration, spec, ours = read_model_tensors(checkpoint, endpoint_url=endpoint_url, region=region)
    files, size = write_peft(spec, ours, output, dtype=DTYPES[dtype], endpoint_url=endpoint_url, region=region)
    return ExportReport(iteration, sum(".lora." in k for k in ours), size, files, time.perf_counter() - start)


def _join_strided(targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """'model/<name>' and 'model/<name>#k' keys -> {name: whole tensor}; a strided parameter's
    chunks (SwiGLU's gate#0, up#1) are rows one after the other."""
    chunks: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in targets.items():
        name, _, k = key[len("model/") :].partition("#")
        chunks.setdefault(name, {})[int(k) if k else 0] = t
    return {name: torch.cat([c[k] for k in sorted(c)], dim=0) for name, c in chunks.items()}


def _imported_config(folder: str | None) -> dict | None:
    """The config.json the job was imported from, when it is still readable (its token ids and
    family survive the round trip); otherwise the job's model section alone decides."""
    if folder is None:
        return None
    try:
        return read_hf_config(folder)
    except HFConfigError:
        return None


def _model_config(spec: JobSpec) -> TransformerConfig:
    vocab = spec.model.vocab_size or build_tokenizer(spec.data.tokenizer).vocab_size
    return TransformerConfig.from_job(spec, vocab)


def export_hf(
    checkpoint: str,
    output: str,
    *,
    dtype: str = "bf16",
    endpoint_url: str | None = None,
    region: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    merge_lora: bool = False,
) -> ExportReport:
    """Write the Hugging Face folder of `checkpoint` to `output` (local or s3://). `merge_lora`:
    the checkpoint is a LoRA job's (adapters only): its base with the adapters merged in
    (engine/hf/lora_export.py)."""
    start = time.perf_counter()
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    iteration, spec, ours = read_model_tensors(checkpoint, endpoint_url=endpoint_url, region=region)
    if spec.model.lora is not None and not merge_lora:
        raise ExportError(
            f"checkpoint {checkpoint} holds LoRA adapters only (model.lora), not a whole model: export them with "
            "--format peft, or the merged model with --format hf --merge-lora"
        )
    base = _imported_config(spec.model.init_from)
    model = _model_config(spec)
    config = {**hf_config_for(spec.model, base, dtype=dtype), "vocab_size": model.true_vocab_size}
    arch = config["architectures"][0]
    if merge_lora:
        from engine.hf.lora_export import merged_hf_tensors

        tensors = merged_hf_tensors(spec, ours, DTYPES[dtype])
    else:
        tensors = {
            k: v.to(DTYPES[dtype]).contiguous()
            for k, v in hf_tensors(
                arch,
                ours,
                dataclasses.replace(Shapes.of(model), rope_interleave=config.get("rope_interleave", True)),
            ).items()
        }
    with tempfile.TemporaryDirectory(prefix="elastron-export-") as tmp:
        folder = Path(tmp)
        files = _write_shards(folder, tensors, max_shard_bytes)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "generation_config.json").write_text(
            json.dumps(_generation_config(config), indent=2) + "\n"
        )
        kind, path = parse_tokenizer_spec(spec.data.tokenizer)
        if kind == "hf":
            source = Path(local_tokenizer_path(path))
            source = source if source.is_dir() else source.parent
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copyfile(source / name, folder / name)
        written = _publish(folder, output, endpoint_url, region)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    return ExportReport(iteration, len(tensors), size, written + files, time.perf_counter() - start)


def _write_shards(folder: Path, tensors: dict[str, torch.Tensor], max_bytes: int) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + the index when over `max_bytes`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors, key=_hf_order):
        t = tensors[name]
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards, strict=True):
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _hf_order(name: str) -> tuple:
    """Layer by layer, so each shard holds whole layers in order (as transformers writes them)."""
    m = re.search(r"\.(\d+)\.", name)
    return (
        int(m.group(1)) if m else -1 if "embed" in name or "wte" in name or "wpe" in name else 1 << 30,
        name,
    )


def _generation_config(config: dict) -> dict:
    out = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            out[key] = config[key]
    return out


def _publish(folder: Path, output: str, endpoint_url: str | None, region: str | None) -> list[str]:
    """Copy the finished folder to `output`; the index (or the single shard) goes last. Returns
    the non-weight files written."""
    storage = open_storage(output, endpoint_url=endpoint_url, region=region)
    names = sorted(p.name for p in folder.iterdir())
    last = [n for n in names if n in ("model.safetensors.index.json", "model.safetensors")]
    for name in [n for n in names if n not in last] + last:
        storage.put_file(folder / name, name)
    return [n for n in names if not n.endswith(".safetensors")]
