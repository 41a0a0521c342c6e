"""DCP checkpoint metadata as data: `.metadata` written and read as JSON, never as a pickle.

Why: DCP's own `.metadata` is a pickle, and unpickling runs whatever the bytes ask for. A
checkpoint folder is written by a job (a tenant) and read by other jobs (resume_from), the
exporter and the operator's tools, and the CRC-32 in the manifest beside it proves nothing: whoever
writes the folder writes the manifest too. So the metadata is JSON, decoded by the explicit code
below into DCP's dataclasses (`Metadata`, `TensorStorageMetadata`, `ChunkStorageMetadata`,
`TensorProperties`, `BytesStorageMetadata`, `MetadataIndex`, `_StorageInfo`, `StorageMeta`) with
an allow-list of dtypes and strict types; nothing in it names a class or a function.

The layout (version 1)::

    {"format": "elastron-dcp-metadata", "version": 1, "dcp_version": "1.0.0",
     "tensors": {fqn: {"dtype": "bfloat16", "size": [..], "requires_grad": false,
                       "pin_memory": false, "chunks": [[offsets, sizes], ...]}},
     "bytes": [fqn, ...],                  # non-tensor items: JSON values (raw_io)
     "storage": [[fqn, offset | null, index | null, file, file_offset, length], ...],
     "planner_data": {fqn: [path element, ...]} | null,
     "storage_meta": {"checkpoint_id": str | null, "save_id": str | null, "modules": [str]}}

A `.metadata` in the old pickled format (raw-v1) is refused with `OldCheckpointFormatError`,
which names the admin-run conversion command (`elastron checkpoint convert`, convert.py): the
only place that still reads such a pickle, through an Unpickler that resolves nothing but the
classes above.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

TAG = "elastron-dcp-metadata"
VERSION = 1
CONVERT_COMMAND = "elastron checkpoint convert"
# The dtypes a checkpoint may hold: names, never looked up as attributes of anything.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# A data file of the checkpoint's own folder (DCP's __<rank>_<n>.distcp): no '/', no '..'.
DATA_FILE = re.compile(r"^__[0-9A-Za-z_]+\.distcp$")
_PICKLE_PROTO = 0x80  # every pickle of protocol 2 and up starts with PROTO


class CheckpointFormatError(ValueError):
    """A checkpoint's `.metadata` that is not data this elastron reads; the message says why."""


class OldCheckpointFormatError(CheckpointFormatError):
    """A checkpoint saved in the old pickled format: only the admin conversion command reads it."""


def old_format_message(where: str) -> str:
    return (
        f"{where}: the checkpoint's .metadata is in the old pickled format (raw-v1), which elastron "
        f"no longer loads because unpickling bytes from storage can run code; an operator converts "
        f"it once with `{CONVERT_COMMAND} {where}` (it reads only checkpoint metadata classes, never a "
        f"payload), then it loads as before"
    )


def is_pickle(data: bytes | bytearray | memoryview) -> bool:
    return len(data) > 0 and bytes(data[:1])[0] == _PICKLE_PROTO


# ------------------------------------------------------------------------------------ encode
def _ints(values: Any, what: str) -> list[int]:
    out = [int(v) for v in values]
    if any(v < 0 for v in out):
        raise CheckpointFormatError(f"{what}: negative value in {out}")
    return out


def _encode_properties(fqn: str, p: TensorProperties) -> dict[str, Any]:
    if p.dtype not in _DTYPE_NAMES:
        raise CheckpointFormatError(
            f"{fqn}: dtype {p.dtype} cannot be checkpointed (allowed: {', '.join(DTYPES)})"
        )
    if p.layout != torch.strided:
        raise CheckpointFormatError(f"{fqn}: layout {p.layout} cannot be checkpointed (dense tensors only)")
    return {
        "dtype": _DTYPE_NAMES[p.dtype],
        "requires_grad": bool(p.requires_grad),
        "pin_memory": bool(p.pin_memory),
    }


def encode(metadata: Metadata) -> bytes:
    """`metadata` as the JSON bytes above; CheckpointFormatError for anything it cannot hold."""
    tensors: dict[str, Any] = {}
    byte_items: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = {
                **_encode_properties(fqn, md.properties),
                "size": _ints(md.size, fqn),
                "chunks": [[_ints(c.offsets, fqn), _ints(c.sizes, fqn)] for c in md.chunks],
            }
        elif isinstance(md, BytesStorageMetadata):
            byte_items.append(fqn)
        else:
            raise CheckpointFormatError(f"{fqn}: unknown storage metadata {type(md).__name__}")
    storage = []
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointFormatError(f"storage_data entry {index!r}: not a MetadataIndex -> _StorageInfo")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointFormatError(f"{index.fqn}: transformed storage items are not supported")
        if not DATA_FILE.match(info.relative_path):
            raise CheckpointFormatError(
                f"{index.fqn}: data file name {info.relative_path!r} is not a DCP data file"
            )
        offset = None if index.offset is None else _ints(index.offset, index.fqn)
        storage.append(
            [index.fqn, offset, index.index, info.relative_path, int(info.offset), int(info.length)]
        )
    planner = metadata.planner_data
    if planner is not None:
        if not isinstance(planner, dict) or not all(
            isinstance(k, str) and isinstance(v, tuple | list) and all(isinstance(e, str | int) for e in v)
            for k, v in planner.items()
        ):
            raise CheckpointFormatError("planner_data: only {fqn: path of str/int} is supported")
        planner = {k: list(v) for k, v in planner.items()}
    sm = metadata.storage_meta
    storage_meta = None
    if sm is not None:
        storage_meta = {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": [str(m) for m in sm.modules],
        }
    doc = {
        "format": TAG,
        "version": VERSION,
        "dcp_version": metadata.version,
        "tensors": tensors,
        "bytes": byte_items,
        "storage": storage,
        "planner_data": planner,
        "storage_meta": storage_meta,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


# ------------------------------------------------------------------------------------ decode
class _Bad(Exception):
    pass


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise _Bad(what)


def _int(v: Any, what: str, *, nonneg: bool = True) -> int:
    _need(type(v) is int and (v >= 0 or not nonneg), f"{what} must be a non-negative integer")
    return v


def _int_list(v: Any, what: str) -> list[int]:
    _need(isinstance(v, list), f"{what} must be a list of integers")
    return [_int(x, what) for x in v]


def _str(v: Any, what: str, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    _need(isinstance(v, str), f"{what} must be a string")
    return v


def _decode_tensor(fqn: str, t: Any) -> TensorStorageMetadata:
    _need(isinstance(t, dict), f"tensors[{fqn!r}] must be an object")
    dtype = t.get("dtype")
    _need(
        isinstance(dtype, str) and dtype in DTYPES,
        f"tensors[{fqn!r}].dtype {dtype!r} is not one of {', '.join(DTYPES)}",
    )
    _need(
        type(t.get("requires_grad")) is bool and type(t.get("pin_memory")) is bool,
        f"tensors[{fqn!r}] flags must be booleans",
    )
    size = _int_list(t.get("size"), f"tensors[{fqn!r}].size")
    chunks = t.get("chunks")
    _need(isinstance(chunks, list), f"tensors[{fqn!r}].chunks must be a list")
    out = []
    for c in chunks:
        _need(isinstance(c, list) and len(c) == 2, f"tensors[{fqn!r}].chunks: each is [offsets, sizes]")
        offsets, sizes = _int_list(c[0], f"{fqn} chunk offsets"), _int_list(c[1], f"{fqn} chunk sizes")
        _need(
            len(offsets) == len(size) == len(sizes),
            f"tensors[{fqn!r}]: a chunk's rank differs from the tensor's",
        )
        _need(
            all(o + s <= n for o, s, n in zip(offsets, sizes, size, strict=True)),
            f"tensors[{fqn!r}]: a chunk lies outside the tensor",
        )
        out.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    props = TensorProperties(
        dtype=DTYPES[dtype],
        layout=torch.strided,
        requires_grad=t["requires_grad"],
        memory_format=torch.contiguous_format,
        pin_memory=t["pin_memory"],
    )
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=out)


def _decode(doc: Any) -> Metadata:
    _need(isinstance(doc, dict) and doc.get("format") == TAG, f"not an {TAG} document")
    _need(doc.get("version") == VERSION, f"version {doc.get('version')!r} is not {VERSION}")
    tensors, byte_items = doc.get("tensors"), doc.get("bytes")
    _need(
        isinstance(tensors, dict) and isinstance(byte_items, list), "tensors must be an object, bytes a list"
    )
    sdm: dict[str, Any] = {}
    for fqn, t in tensors.items():
        sdm[fqn] = _decode_tensor(fqn, t)
    for fqn in byte_items:
        _need(isinstance(fqn, str) and fqn not in sdm, f"bytes: {fqn!r} must be a new name")
        sdm[fqn] = BytesStorageMetadata()
    storage = doc.get("storage")
    _need(isinstance(storage, list), "storage must be a list")
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    for row in storage:
        _need(
            isinstance(row, list) and len(row) == 6,
            "storage: each row is [fqn, offset, index, file, offset, length]",
        )
        fqn, offset, index, name, at, length = row
        _need(isinstance(fqn, str) and fqn in sdm, f"storage: {fqn!r} is not a stored item")
        offset = None if offset is None else _int_list(offset, f"storage[{fqn!r}].offset")
        index = None if index is None else _int(index, f"storage[{fqn!r}].index")
        _need(
            isinstance(name, str) and DATA_FILE.match(name) is not None,
            f"storage[{fqn!r}]: file {name!r} is not a DCP data file of this folder",
        )
        info = _StorageInfo(
            name, _int(at, f"storage[{fqn!r}] offset"), _int(length, f"storage[{fqn!r}] length")
        )
        storage_data[MetadataIndex(fqn, offset, index)] = info
    planner = doc.get("planner_data")
    if planner is not None:
        _need(isinstance(planner, dict), "planner_data must be an object or null")
        for k, v in planner.items():
            _need(
                isinstance(v, list) and all(isinstance(e, str) or type(e) is int for e in v),
                f"planner_data[{k!r}] must be a list of names",
            )
        planner = {k: tuple(v) for k, v in planner.items()}
    sm = doc.get("storage_meta")
    storage_meta = None
    if sm is not None:
        _need(isinstance(sm, dict), "storage_meta must be an object or null")
        modules = sm.get("modules", [])
        _need(
            isinstance(modules, list) and all(isinstance(m, str) for m in modules),
            "storage_meta.modules must be names",
        )
        storage_meta = StorageMeta(
            checkpoint_id=_str(sm.get("checkpoint_id"), "storage_meta.checkpoint_id", optional=True),
            save_id=_str(sm.get("save_id"), "storage_meta.save_id", optional=True),
            modules=list(modules),
        )
    version = _str(doc.get("dcp_version"), "dcp_version", optional=True)
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=planner,
        storage_data=storage_data,
        storage_meta=storage_meta,
        version=version,
    )


def decode(data: bytes | bytearray | memoryview, where: str) -> Metadata:
    """The Metadata in `data` (a `.metadata` file of checkpoint `where`). OldCheckpointFormatError
    for a pickle (never unpickled here), CheckpointFormatError for anything else not ours."""
    if is_pickle(data):
        raise OldCheckpointFormatError(old_format_message(where))
    try:
        doc = json.loads(bytes(data))
        return _decode(doc)
    except (ValueError, _Bad) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointFormatError(
            f"{where}: the checkpoint's .metadata is not valid {TAG} data: {err}"
        ) from None


# ------------------------------------------------------------------------ non-tensor items
def encode_value(fqn: str, value: Any) -> bytes:
    """A non-tensor state-dict value as JSON bytes; TypeError naming it when it is not JSON data."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"checkpoint item {fqn!r}: non-tensor values are stored as JSON, and {type(value).__name__} "
            f"is not JSON data ({err}); make it a tensor or plain numbers/strings/lists/dicts"
        ) from None


def decode_value(fqn: str, data: bytes | bytearray | memoryview, where: str) -> Any:
    if is_pickle(data):
        raise CheckpointFormatError(
            f"{where}: checkpoint item {fqn!r} is a pickle, which elastron never loads (non-tensor items are JSON)"
        )
    try:
        return json.loads(bytes(data))
    except ValueError as err:
        raise CheckpointFormatError(f"{where}: checkpoint item {fqn!r} is not JSON data: {err}") from None
