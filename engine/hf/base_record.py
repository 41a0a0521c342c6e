"""Which base model a LoRA job's checkpoint was trained on, so a resume cannot put its adapters
on another one.

A LoRA checkpoint holds the adapters and their optimizer state only; the frozen base comes back
from `model.init_from` on every start (or, without init_from, from the seed's initialisation,
which is layout independent). Adapters are meaningless on any other base, and a folder can be
overwritten in place with another model of the same architecture, so the checkpoint records a
digest of the base's files: sha256 over config.json, the safetensors index and every weight
file (name, size, bytes), streamed through the same storage the import reads (local or S3; on
S3 that is one full read per process, at the first save or resume). `LoRABase` is the
checkpoint part (meta only, engine/checkpointing/stateful.py's protocol) that writes it and, on
load, fails naming both bases when they differ.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

from engine.checkpointing.backends import open_storage

CHUNK = 8 * 2**20
META_KEY = "lora_base"


class BaseModelMismatch(ValueError):
    """The checkpoint's adapters were trained on another base than model.init_from's."""


@functools.cache
def folder_digest(uri: str) -> str:
    """sha256 of a Hugging Face model folder's config.json, index and weight files (cached per
    process: the files of a running job's base do not change)."""
    from engine.hf.reader import INDEX, HFFolder

    storage = open_storage(os.path.expanduser(uri.rstrip("/")))
    folder = HFFolder(uri, storage)
    files = ["config.json", *([INDEX] if storage.exists(INDEX) else []), *sorted({t.file for t in folder.tensors.values()})]
    sizes = storage.sizes("")
    h = hashlib.sha256()
    for name in files:
        size = sizes[name]
        h.update(f"{name}\0{size}\0".encode())
        buf = bytearray(CHUNK)
        for offset in range(0, size, CHUNK):
            view = memoryview(buf)[: min(CHUNK, size - offset)]
            storage.read_into(name, offset, [view])
            h.update(view)
    return h.hexdigest()


class LoRABase:
    """Checkpoint part: meta["lora_base"] = {"init_from", "digest"} of the base the adapters sit
    on (`init_from` None: the seed's random base, `seed` recorded instead)."""

    def __init__(self, init_from: str | None, seed: int) -> None:
        self.init_from, self.seed = init_from, seed

    def _record(self) -> dict[str, Any]:
        if self.init_from is None:
            return {"init_from": None, "seed": self.seed}
        return {"init_from": self.init_from, "digest": folder_digest(self.init_from)}

    def state_dict(self) -> dict[str, Any]:
        return {META_KEY: self._record()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, mine = state_dict.get(META_KEY), self._record()
        if saved is None or saved == mine:
            return
        def describe(r: dict[str, Any]) -> str:
            if r.get("init_from") is None:
                return f"a random base (training.seed {r.get('seed')})"
            return f"{r['init_from']} (sha256 {r.get('digest')})"
        raise BaseModelMismatch(
            f"model.init_from: this checkpoint's LoRA adapters were trained on {describe(saved)}, but this job's "
            f"base is {describe(mine)}: resume with the base it was trained on, or start a new job"
        )
