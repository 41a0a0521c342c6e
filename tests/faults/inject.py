"""Storage faults injected inside a rank process, at the write layer of `LocalStorage`.

Ranks run in processes forked from a server (engine.launcher.spawn), so a test cannot patch them
from outside: it hands a `StorageFaults` to the rank function, which calls `install()` first.
A fault hits the shard files (`*.distcp`), the `.metadata`, the `manifest.json` or `latest` of
the iterations it names, for its first `attempts` tries of each file (a per-process count), after
`after_bytes` bytes of a shard have gone out: a disk that fills up half way through a file.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StorageFaults:
    iterations: tuple[int, ...] = ()
    target: str = "shard"  # shard | metadata | manifest | latest
    error: int = errno.ENOSPC
    attempts: int = 10**6  # tries of each file that fail (then it works)
    after_bytes: int = 4096  # shards: bytes written before the error
    ranks: tuple[int, ...] | None = None  # None: every rank
    delay_s: float = 0.0  # instead of an error: every shard write of those iterations is this slow
    counts: dict = field(default_factory=dict, compare=False)

    def _hits(self, key: str) -> bool:
        import torch.distributed as dist

        if self.ranks is not None and dist.get_rank() not in self.ranks:
            return False
        parts = key.split("/")
        folder = next((p for p in parts if p.startswith("iter_")), None)
        return folder is not None and int(folder[5:]) in self.iterations

    def _fails(self, key: str) -> bool:
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key] <= self.attempts

    def error_for(self, key: str) -> OSError:
        return OSError(self.error, os.strerror(self.error), key)

    def install(self) -> None:
        """Patch LocalStorage's writes in this process."""
        from engine.checkpointing import local_storage as ls

        faults = self
        real_open_write, real_put_bytes = ls.LocalStorage.open_write, ls.LocalStorage.put_bytes

        def open_write(storage, key):
            stream = real_open_write(storage, key)
            if faults.target != "shard" or not key.endswith(".distcp") or not faults._hits(key):
                return stream
            if faults.delay_s:
                real_write = stream.write

                def slow_write(data):
                    time.sleep(faults.delay_s)
                    real_write(data)

                stream.write = slow_write
                return stream
            if not faults._fails(key):
                return stream
            real_write = stream.write

            def write(data):
                room = faults.after_bytes - stream.size
                if room < len(memoryview(data).cast("B")):
                    if room > 0:
                        real_write(memoryview(data).cast("B")[:room])  # the disk fills up mid-file
                    raise faults.error_for(key)
                real_write(data)

            stream.write = write
            return stream

        def put_bytes(storage, key, data):
            name = key.rsplit("/", 1)[-1]
            wanted = {"metadata": ".metadata", "manifest": "manifest.json", "latest": "latest"}.get(faults.target)
            hit = faults._hits(key) if name != "latest" else int(bytes(data)) in faults.iterations
            if name == wanted and hit and faults._fails(key):
                raise faults.error_for(key)
            return real_put_bytes(storage, key, data)

        ls.LocalStorage.open_write = open_write
        ls.LocalStorage.put_bytes = put_bytes


def leftovers(root) -> dict[str, list[str]]:
    """Every iter_ folder under `root` (recursively) -> its files, temp files included."""
    from pathlib import Path

    out = {}
    for folder in sorted(Path(root).rglob("iter_*")):
        if folder.is_dir():
            out[folder.name] = sorted(p.name for p in folder.rglob("*") if p.is_file())
    return out
