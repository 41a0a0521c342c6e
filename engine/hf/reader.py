"""Read slices of the tensors of a Hugging Face model folder, local or on S3, without whole files.

A safetensors file is an 8-byte header length, a JSON header (per tensor: dtype, shape, byte
offsets) and the raw row-major data. So the rows `a:b` of a tensor are one contiguous byte range:
a rank reads exactly its rows straight into the tensor it fills, through `Storage.read_into`
(a `pread` locally, one ranged GET on S3). A column slice (a row-parallel weight's input
dimension) is one range per row: locally it is cut from safetensors' memory map of the file (so
a TP rank touches about 1/tp of the pages); on S3 the rows' whole span is read in one GET and cut here, because one GET
per row would cost more than the bytes it saves. `bytes_read` counts what was requested from
storage, for the import's report and bench/hf_import.py.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpointing.backends import open_storage
from engine.checkpointing.local_storage import LocalStorage
from engine.checkpointing.storage import Storage

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFCheckpointError(ValueError):
    """A model folder whose weights do not fit the job; the message names the tensor or file."""


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file


class HFFolder:
    """The tensors of a model folder: which file holds each, its dtype, shape and bytes."""

    def __init__(self, uri: str, storage: Storage | None = None):
        self.uri = uri.rstrip("/")
        self.storage = storage or open_storage(os.path.expanduser(self.uri))
        self.bytes_read = 0
        self._lock = threading.Lock()
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[str, object] = {}
        for file in self._files():
            self._read_header(file)

    def _files(self) -> list[str]:
        if self.storage.exists(INDEX):
            index = json.loads(self.storage.get_bytes(INDEX))
            return sorted(set(index.get("weight_map", {}).values()))
        if self.storage.exists(SINGLE):
            return [SINGLE]
        raise HFCheckpointError(
            f"model.init_from: {self.uri} has neither {SINGLE} nor {INDEX} (only safetensors weights are read)"
        )

    def _read_header(self, file: str) -> None:
        head = bytearray(8)
        self._read(file, 0, head)
        (length,) = struct.unpack("<Q", head)
        if length > 100 * 2**20:
            raise HFCheckpointError(f"{self.uri}/{file}: a {length}-byte header is not a safetensors file")
        header = bytearray(length)
        self._read(file, 8, header)
        for name, entry in json.loads(header).items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in DTYPES:
                raise HFCheckpointError(
                    f"{file}: tensor {name} has dtype {entry['dtype']}, which torch cannot hold"
                )
            start, _end = entry["data_offsets"]
            self.tensors[name] = TensorInfo(
                file, DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + start
            )

    def _read(self, file: str, offset: int, buf: bytearray | memoryview) -> None:
        self.storage.read_into(file, offset, [buf])
        with self._lock:
            self.bytes_read += len(buf)

    def _mapped(self, file: str):
        """safetensors' memory map of a local file: a column slice copies just its bytes."""
        from safetensors import safe_open

        if file not in self._maps:
            self._maps[file] = safe_open(str(self.storage.local_path(file)), framework="pt")
        return self._maps[file]

    def file_bytes(self) -> int:
        """Total size of the weight files (for the bytes-read ratio)."""
        sizes = self.storage.sizes("")
        return sum(sizes.get(f, 0) for f in {t.file for t in self.tensors.values()})

    def read(
        self, name: str, rows: slice, cols: slice | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows `rows` (and columns `cols`, for a 2-D tensor) of tensor `name`, in its own dtype;
        whole rows go straight into `out` (contiguous, that dtype and shape) when given."""
        info = self.tensors[name]
        shape = info.shape
        inner = 1
        for n in shape[1:]:
            inner *= n
        item = torch.tensor([], dtype=info.dtype).element_size()
        r0, r1, _ = rows.indices(shape[0])
        if cols is None or (len(shape) == 2 and cols.indices(shape[1])[:2] == (0, shape[1])):
            if out is None:
                out = torch.empty((r1 - r0, *shape[1:]), dtype=info.dtype)
            if (
                tuple(out.shape) != (r1 - r0, *shape[1:])
                or out.dtype != info.dtype
                or not out.is_contiguous()
            ):
                raise ValueError(f"read {name}: out is {out.dtype} {list(out.shape)}")
            self._read(info.file, info.offset + r0 * inner * item, _bytes(out))
            return out
        c0, c1, _ = cols.indices(shape[1])
        if isinstance(self.storage, LocalStorage):
            out = self._mapped(info.file).get_slice(name)[r0:r1, c0:c1]
            with self._lock:
                self.bytes_read += out.numel() * item
            return out
        span = torch.empty((r1 - r0, shape[1]), dtype=info.dtype)
        self._read(info.file, info.offset + r0 * shape[1] * item, _bytes(span))
        return span[:, c0:c1].contiguous()


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(bytearray(0))


def local_folder(path: str | Path) -> HFFolder:
    return HFFolder(str(path), LocalStorage(Path(path).expanduser()))
