"""`elastron checkpoint convert PATH`: rewrite checkpoints of the old pickled format (raw-v1) as data.

Why a command of its own: every load path (resume, resharding, export) refuses a raw-v1
checkpoint, because its `.metadata` is a pickle and unpickling bytes from storage runs code
(raw_io.py, metadata_json.py). An operator who trusts a checkpoint converts it once; this is the
only code in elastron that still reads such a pickle, and even here it runs no payload:
`_MetadataUnpickler.find_class` resolves only DCP's metadata classes, torch.Size and the dtypes
of metadata_json.DTYPES (a layout only as torch.strided), so a crafted pickle fails with
UnpicklingError naming what it asked for. A non-tensor (BYTE_IO) item, a torch.save pickle, is read
with `torch.load(weights_only=True)` (torch's own restricted unpickler) and rewritten as JSON.

Per committed checkpoint: the `.metadata` bytes are checked against the manifest (as a load
would), decoded as above, re-encoded as JSON (which checks every field again), written in place
of the pickle, and then the manifest is rewritten with the new checksum (and size) and
`meta.shard_format` raw-v2, last: a crash between the two leaves a `.metadata` that is already
JSON under a raw-v1 manifest, which loads refuse and a rerun of the command finishes (it
recognises JSON and only rewrites the manifest). Checkpoints already in raw-v2 are left alone.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from engine.checkpointing import metadata_json, raw_io
from engine.checkpointing.backends import open_storage
from engine.checkpointing.commit import (
    MANIFEST,
    Checksums,
    FileEntry,
    committed_iterations,
    crc32_hex,
    iteration_key,
    read_manifest,
    resolve_checkpoint,
)
from engine.checkpointing.storage import Storage

_DCP = "torch.distributed.checkpoint.metadata"
_CLASSES: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): Metadata,
    (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP, "TensorProperties"): TensorProperties,
    (_DCP, "MetadataIndex"): MetadataIndex,
    (_DCP, "StorageMeta"): StorageMeta,
    (_DCP, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
}
CONVERTED_FILE = "__converted_0.distcp"  # where converted non-tensor items go (JSON values)


class ConvertError(ValueError):
    """A checkpoint the conversion refuses; the message says which and why."""


def _layout(name: Any) -> torch.layout:
    """Stands in for torch.serialization._get_layout: a dense layout is all DCP metadata holds."""
    if name != "torch.strided":
        raise pickle.UnpicklingError(f"refused layout {name!r}: only torch.strided")
    return torch.strided


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes, torch.Size and allowed dtypes; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return _CLASSES[(module, name)]
        if module == "torch" and name in metadata_json.DTYPES:
            return metadata_json.DTYPES[name]
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        raise pickle.UnpicklingError(
            f"refused {module}.{name}: a checkpoint's .metadata may name only DCP metadata classes, "
            f"torch.Size and tensor dtypes"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id: DCP metadata has none")


def read_old_metadata(data: bytes, where: str) -> Metadata:
    """The Metadata in a raw-v1 `.metadata` pickle, without running anything it asks for."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # noqa: BLE001 - any failure of a crafted pickle is a refusal
        raise ConvertError(
            f"{where}: .metadata is not DCP checkpoint metadata, not converted: {err}"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ConvertError(
            f"{where}: .metadata holds a {type(metadata).__name__}, not DCP Metadata; not converted"
        )
    return metadata


@dataclass
class ConvertReport:
    converted: list[int] = field(default_factory=list)
    already: list[int] = field(default_factory=list)


def _checked(entry: dict[str, Any], data: bytes) -> str | None:
    """Why `data` is not the file the manifest entry lists, or None."""
    if len(data) != entry.get("size"):
        return f"size {len(data)} bytes, manifest says {entry.get('size')}"
    if "sha256" in entry:  # format 1 manifests
        digest = hashlib.sha256(data).hexdigest()
        return (
            None
            if digest == entry["sha256"]
            else f"sha256 {digest[:12]}..., manifest says {entry['sha256'][:12]}..."
        )
    return Checksums(entry).problem(0, data)


def _entry_like(old: dict[str, Any], name: str, data: bytes) -> dict[str, Any]:
    if "sha256" in old:
        return {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return {**FileEntry(name, len(data), ((0, len(data), crc32_hex(data)),)).to_json(), "name": name}


def _convert_bytes_items(
    storage: Storage, folder: str, metadata: Metadata, files: list[dict], where: str
) -> None:
    """Rewrite the torch.save'd non-tensor items as JSON values in CONVERTED_FILE (in `files` too)."""
    items = [
        (idx, info)
        for idx, info in (metadata.storage_data or {}).items()
        if isinstance(metadata.state_dict_metadata.get(idx.fqn), BytesStorageMetadata)
    ]
    if not items:
        return
    by_name = {e["name"]: e for e in files}
    out, chunks = bytearray(), []
    for idx, info in items:
        name = info.relative_path
        if not metadata_json.DATA_FILE.match(name) or name not in by_name:
            raise ConvertError(f"{where}: item {idx.fqn!r} points at {name!r}, not a file of the checkpoint")
        raw = bytearray(info.length)
        storage.read_into(f"{folder}/{name}", info.offset, [raw])
        raw = bytes(raw)
        entry = by_name[name]
        if "chunks" in entry and (problem := Checksums(entry).problem(info.offset, raw)) is not None:
            raise ConvertError(f"{where}: item {idx.fqn!r} in {name}: {problem}")
        try:
            value = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as err:  # noqa: BLE001 - a crafted item is refused, never run
            raise ConvertError(f"{where}: item {idx.fqn!r} is not plain data, not converted: {err}") from None
        data = metadata_json.encode_value(idx.fqn, value)
        chunks.append((len(out), len(data), crc32_hex(data)))
        metadata.storage_data[idx] = _StorageInfo(CONVERTED_FILE, len(out), len(data))
        out += data
    storage.put_bytes(f"{folder}/{CONVERTED_FILE}", bytes(out))
    files[:] = [e for e in files if e["name"] != CONVERTED_FILE]
    files.append(FileEntry(CONVERTED_FILE, len(out), tuple(chunks)).to_json())


def convert_iteration(storage: Storage, job_root: str, iteration: int) -> bool:
    """Convert one committed checkpoint; False if it already was raw-v2. ConvertError if refused."""
    manifest = read_manifest(storage, job_root, iteration)
    folder = iteration_key(job_root, iteration)
    where = f"{storage.uri.rstrip('/')}/{folder}"
    meta, files = manifest.get("meta") or {}, list(manifest["files"])
    fmt = meta.get("shard_format")
    if fmt not in (*raw_io.OLD_FORMATS, raw_io.FORMAT):
        raise ConvertError(
            f"{where}: shard format {fmt!r} is not one this command converts ({', '.join(raw_io.OLD_FORMATS)})"
        )
    entry = next((e for e in files if e.get("name") == raw_io.METADATA), None)
    if entry is None:
        raise ConvertError(f"{where}: the manifest lists no {raw_io.METADATA}")
    data = storage.get_bytes(f"{folder}/{raw_io.METADATA}")
    if metadata_json.is_pickle(data):
        problem = _checked(entry, data)
        if problem is not None:
            raise ConvertError(
                f"{where}: {raw_io.METADATA} is not the file the manifest lists ({problem}); not converted"
            )
        metadata = read_old_metadata(data, where)
        _convert_bytes_items(storage, folder, metadata, files, where)
        try:
            new = metadata_json.encode(metadata)
            metadata_json.decode(new, where)  # what every load will read back
        except metadata_json.CheckpointFormatError as err:
            raise ConvertError(f"{where}: not converted: {err}") from None
        storage.put_bytes(f"{folder}/{raw_io.METADATA}", new)
    else:
        metadata_json.decode(data, where)  # already data (a rerun after a crash): only the manifest
        if fmt == raw_io.FORMAT:
            return False
        new = data
    files = [_entry_like(e, raw_io.METADATA, new) if e.get("name") == raw_io.METADATA else e for e in files]
    manifest = {
        **manifest,
        "files": files,
        "meta": {**meta, "shard_format": raw_io.FORMAT},
        "converted_from": fmt,
    }
    storage.put_bytes(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
    return True


def convert_checkpoints(
    uri: str, *, endpoint_url: str | None = None, region: str | None = None
) -> ConvertReport:
    """Convert the checkpoint `uri` names: a job's checkpoint root (every committed checkpoint in
    it) or one iter_NNNNNNN folder; local or s3://."""
    root_uri, _, last = uri.rstrip("/").rpartition("/")
    if last.startswith("iter_") and root_uri:
        storage, key = open_storage(root_uri, endpoint_url=endpoint_url, region=region), last
    else:
        storage, key = open_storage(uri.rstrip("/"), endpoint_url=endpoint_url, region=region), ""
    found = resolve_checkpoint(storage, key)
    if found is None:
        raise ConvertError(f"no committed checkpoint at {uri}")
    job_root, newest = found
    iterations = [newest] if key else committed_iterations(storage, job_root)
    report = ConvertReport()
    for iteration in iterations:
        (report.converted if convert_iteration(storage, job_root, iteration) else report.already).append(
            iteration
        )
    return report
