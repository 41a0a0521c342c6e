"""Reading a Hugging Face model folder's config.json, once, where a job is submitted.

`resolve_hf_config(spec)` is the one step of the job spec that does I/O: for `model.init_from`
it reads config.json (a local folder, or one GET on `s3://` with boto3's default credential and
endpoint chain, e.g. AWS_ENDPOINT_URL), merges the architecture fields it fixes into the `model`
section (hf_fields.py) and records `model.hf_config_digest`, the sha256 of the bytes read. A
spec carrying the digest has its fields merged, so validating it again (the reconciler, an
elastic size check, each rank, a checkpoint's job record) reads nothing: `ModelSpec` itself never
reads, and refuses an `init_from` whose fields were not merged. `parse_job` runs this step
before validating; the API runs it in a worker thread, off its event loop.

engine/jobspec imports nothing else of the engine, so this reads with `json` and boto3 only;
the importer and exporter (engine/hf/) read the same file through `read_hf_config`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engine.jobspec.hf_families import HFConfigError
from engine.jobspec.hf_fields import check_sliding_window, hf_model_fields, merge_fields
from engine.jobspec.model import ModelSpec

__all__ = ["HFConfigError", "has_tokenizer", "load_hf_config", "read_hf_config", "resolve_hf_config"]


def resolve_hf_config(data: dict[str, Any]) -> dict[str, Any]:
    """The job spec `data` (a dict) with `model.init_from`'s config.json read into it: the
    architecture fields merged into `model` (a field set to another value is an HFConfigError
    naming both), `model.hf_config_digest` set, and `data.tokenizer` defaulting to the folder's
    own tokenizer. A spec without init_from, or one that carries a digest (resolved already), is
    returned as it is, without I/O. `data` is not modified."""
    model = data.get("model")
    if not isinstance(model, dict) or not model.get("init_from") or model.get("hf_config_digest"):
        return data
    folder = model["init_from"]
    if not isinstance(folder, str):
        raise HFConfigError("model.init_from must be a path or an s3:// URI to a Hugging Face model folder")
    cfg, digest = load_hf_config(folder)
    seq_length = model.get("seq_length", ModelSpec.model_fields["seq_length"].default)
    if isinstance(seq_length, int) and not isinstance(seq_length, bool):  # else validation names it
        check_sliding_window(cfg, seq_length)
    out = {**data, "model": {**merge_fields(hf_model_fields(cfg), model), "hf_config_digest": digest}}
    section = data.get("data") or {}
    if isinstance(section, dict) and "tokenizer" not in section and has_tokenizer(folder):
        # data.tokenizer defaults to the tokenizer of the folder the model starts from
        out["data"] = {**section, "tokenizer": f"hf:{folder}"}
    return out


def load_hf_config(folder: str | Path) -> tuple[dict[str, Any], str]:
    """(config.json of a local or s3:// folder, the sha256 hex digest of its bytes)."""
    where, raw = _read_config_bytes(str(folder))
    return _parse(where, raw), hashlib.sha256(raw).hexdigest()


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """config.json of a local folder or an s3://bucket/prefix folder."""
    return load_hf_config(folder)[0]


def has_tokenizer(folder: str) -> bool:
    """Whether a model folder ships a fast tokenizer (tokenizer.json), the default data.tokenizer."""
    if not folder.startswith("s3://"):
        return (Path(folder).expanduser() / "tokenizer.json").is_file()
    try:
        _s3_get(folder, "tokenizer_config.json")
        return True
    except HFConfigError:
        return False


def _read_config_bytes(folder: str) -> tuple[str, bytes]:
    if folder.startswith("s3://"):
        return f"{folder.rstrip('/')}/config.json", _s3_get(folder, "config.json")
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        raise HFConfigError(f"model.init_from: {folder} has no config.json")
    return str(path), path.read_bytes()


def _parse(where: str, raw: bytes) -> dict[str, Any]:
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFConfigError(f"model.init_from: {where} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise HFConfigError(f"model.init_from: {where} is not a JSON object")
    return cfg


def _s3_get(folder: str, name: str) -> bytes:
    """One object of an s3:// folder (the one network read of this module)."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = folder[len("s3://") :].partition("/")
    key = f"{prefix.strip('/')}/{name}".lstrip("/")
    try:
        return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    except (ClientError, BotoCoreError) as e:
        raise HFConfigError(f"model.init_from: cannot read s3://{bucket}/{key}: {e}") from e
