"""The checkpoint commit protocol: when a checkpoint counts as saved, which one to resume from.

Layout under a job root key R (any `Storage`, local or S3)::

    R/iter_0000010/<shard files>     written first, by every rank (DCP's files, uploaded)
    R/iter_0000010/manifest.json     written LAST, by one rank: names, sizes, checksums of every file
    R/latest                         text: the iteration number of the newest commit

Why the manifest goes last: ranks die mid-save (node loss, preemption, OOM) and Ray reports are
at-least-once, so a storage folder full of shard files proves nothing. A reader only ever trusts a
folder whose manifest exists, and the manifest is written (atomically) only after every file it
lists is already in storage; so "manifest visible" implies "checkpoint complete". `latest` is a
hint written after the manifest: if it points at a folder without a manifest, readers fall back to
the newest committed folder. Deleting runs in the opposite order (manifest first), so a deletion
that dies half way leaves an uncommitted folder, never a committed one with holes.

The manifest also carries each file's size and checksums, and a load checks them: a shard that was
truncated, bit-flipped or deleted after the commit is reported by name (CheckpointCorruptError),
with the previous committed checkpoint named as the way out, instead of failing deep inside DCP.

Checksums are CRC-32 (zlib: several GB/s, and it releases the GIL) of consecutive byte ranges
(`chunks`) that tile each file: one per tensor, computed by the writer from the bytes it is
sending, so a save never reads its files back; and a load checks exactly the bytes each rank
reads, as it reads them, instead of a verification pass that read every shard once more (sha256
of whole files was the largest cost of a local load). CRC-32 guards against accidental damage
(disk rot, truncation, a bad transfer), which is what this check is for, not against tampering.
Format 1 manifests (sha256 of whole files) still load: `open_checkpoint` verifies those files
whole before anything reads them.

Retention keeps the newest `keep` committed checkpoints plus the one `latest` names, and deletes
uncommitted `iter_` folders older than the latest checkpoint (debris of crashed saves); uncommitted
folders newer than it are left alone, since an (async) save may be writing them right now.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.checkpointing.local_storage import LocalStorage
from engine.checkpointing.storage import Buffer, Storage, check_key
from engine.jobspec.layout import ITERATION_FOLDER, iteration_folder

logger = logging.getLogger(__name__)

FORMAT = "elastron-checkpoint"
FORMAT_VERSION = 2  # 2: per-chunk crc32; 1: whole-file sha256 (still read)
CHECKSUM = "crc32"
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointCorruptError(RuntimeError):
    """A committed checkpoint's files do not match its manifest (missing, wrong size or checksum)."""

    def __init__(self, message: str, *, iteration: int, files: list[str], previous: int | None) -> None:
        super().__init__(message)
        self.iteration = iteration
        self.files = files
        self.previous = previous

    def __reduce__(self):
        """Picklable, so one rank's verdict can be shared with every rank."""
        return _rebuild_corrupt_error, (str(self), self.iteration, self.files, self.previous)


def _rebuild_corrupt_error(message: str, iteration: int, files: list[str], previous: int | None):
    return CheckpointCorruptError(message, iteration=iteration, files=files, previous=previous)


class ShardCorruptError(Exception):
    """What one rank found wrong while reading a checkpoint's files: `problems` = [(file, why)].

    Raised by the shard reader inside DCP's load, which hands every rank's failure to every rank;
    the checkpointer then raises one CheckpointCorruptError for the checkpoint (`corrupt_error`).
    """

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"shard {name!r}: {why}" for name, why in problems))
        self.problems = list(problems)

    def __reduce__(self):
        return ShardCorruptError, (self.problems,)


def crc32_hex(data: Buffer, value: int = 0) -> str:
    return f"{zlib.crc32(data, value):08x}"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: `name` relative to the iteration folder ('/'-separated), its size,
    and `chunks`: (offset, length, hex digest) of consecutive byte ranges that tile the file."""

    name: str
    size: int
    chunks: tuple[tuple[int, int, str], ...]
    algorithm: str = CHECKSUM

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "size": int(self.size),
            "algorithm": self.algorithm,
            "chunks": [[int(o), int(n), str(d)] for o, n, d in self.chunks],
        }


def _chunks(entry: dict[str, Any]) -> list[tuple[int, int, str]]:
    """An entry's chunks, checked to tile [0, size) in order with this module's algorithm."""
    if entry.get("algorithm") != CHECKSUM or "chunks" not in entry:
        raise ValueError(f"manifest entry {entry.get('name')!r} has no {CHECKSUM} chunk checksums")
    chunks = [(int(o), int(n), str(d)) for o, n, d in entry["chunks"]]
    end = 0
    for offset, length, _digest in chunks:
        if offset != end or length < 0:
            raise ValueError(f"manifest entry {entry['name']!r}: chunks do not tile the file at byte {end}")
        end += length
    if end != entry["size"]:
        raise ValueError(f"manifest entry {entry['name']!r}: chunks cover {end} bytes of {entry['size']}")
    return chunks


class Checksums:
    """One manifest entry's chunk checksums, to check bytes as they are read."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self.name = entry["name"]
        self._at = {o: (n, d) for o, n, d in _chunks(entry) if n}

    def problem(self, offset: int, data: Buffer) -> str | None:
        """Why `data`, read at `offset`, does not match the manifest, or None if it does. The bytes
        must be whole chunks (the writer makes one per tensor, and the reader reads whole tensors)."""
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            chunk = self._at.get(offset + pos)
            if chunk is None or pos + chunk[0] > len(view):
                return f"bytes {offset}-{offset + len(view) - 1} are not whole checksummed chunks"
            length, digest = chunk
            got = crc32_hex(view[pos : pos + length])
            if got != digest:
                return f"{CHECKSUM} of bytes {offset + pos}-{offset + pos + length - 1} is {got}, manifest says {digest}"
            pos += length
        return None


def checksum_file(
    path: Path | str, name: str | None = None, *, chunk_size: int = 64 * 1024 * 1024
) -> FileEntry:
    """The manifest entry of a local file, in chunks of `chunk_size` bytes (for files that were not
    written through raw_io's writer, which checksums each tensor as it goes)."""
    path = Path(path)
    chunks, offset = [], 0
    with open(path, "rb") as f:
        while data := f.read(chunk_size):
            chunks.append((offset, len(data), crc32_hex(data)))
            offset += len(data)
    return FileEntry(name or path.name, offset, tuple(chunks))


def sha256_file(path: Path | str, *, chunk_size: int = 4 * 1024 * 1024) -> str:
    """Hex sha256 of a file, read in chunks (format 1 manifests; shards can be many GiB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def iteration_key(job_root: str, iteration: int) -> str:
    """Key of one checkpoint's folder: f"{job_root}/iter_{iteration:07d}" ("" job_root = storage root)."""
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ValueError(f"checkpoint iteration must be a non-negative int, got {iteration!r}")
    return _join(check_key(job_root, allow_empty=True), iteration_folder(iteration))


def _where(storage: Storage, job_root: str) -> str:
    return f"{storage.uri.rstrip('/')}/{job_root}" if job_root else storage.uri


def _iter_folders(storage: Storage, job_root: str) -> dict[int, bool]:
    """iteration -> whether its folder has a manifest, for every iter_ folder directly under job_root."""
    root = check_key(job_root, allow_empty=True)
    cut = len(root) + 1 if root else 0
    found: dict[int, bool] = {}
    for key in storage.list(root):
        folder, _, rest = key[cut:].partition("/")
        m = ITERATION_FOLDER.match(folder)
        if m is None or not rest:
            continue
        it = int(m.group(1))
        found[it] = found.get(it, False) or rest == MANIFEST
    return found


def committed_iterations(storage: Storage, job_root: str) -> list[int]:
    """Iterations under job_root whose manifest exists, oldest first."""
    return sorted(it for it, committed in _iter_folders(storage, job_root).items() if committed)


def _latest_pointer(storage: Storage, job_root: str) -> int | None:
    try:
        text = storage.get_bytes(_join(check_key(job_root, allow_empty=True), LATEST)).decode().strip()
        return int(text)
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None


def latest_checkpoint(storage: Storage, job_root: str) -> int | None:
    """The iteration to resume from: `latest` if committed, else the newest committed, else None."""
    pointer = _latest_pointer(storage, job_root)
    if pointer is not None and storage.exists(_join(iteration_key(job_root, pointer), MANIFEST)):
        return pointer
    committed = committed_iterations(storage, job_root)
    if pointer is not None:
        logger.warning(
            "%s/latest names iteration %d, which has no manifest; using the newest committed (%s)",
            _where(storage, job_root),
            pointer,
            committed[-1] if committed else None,
        )
    return committed[-1] if committed else None


def commit_checkpoint(
    storage: Storage,
    job_root: str,
    iteration: int,
    files: list[FileEntry],
    meta: dict[str, Any],
    *,
    keep: int | None = None,
) -> None:
    """Publish a checkpoint whose files are already in storage: manifest, then `latest`, then retention.

    Raises FileNotFoundError (and writes nothing) if any listed file is not in storage.
    `keep`: apply retention with this many committed checkpoints kept (None: keep all).
    """
    folder = iteration_key(job_root, iteration)
    names = [check_key(f.name) for f in files]
    if not names:
        raise ValueError(f"checkpoint iteration {iteration}: no files to commit")
    if len(set(names)) != len(names):
        raise ValueError(f"checkpoint iteration {iteration}: duplicate file names in {names}")
    if MANIFEST in names:
        raise ValueError(f"checkpoint iteration {iteration}: a file may not be called {MANIFEST}")
    entries = [{**f.to_json(), "name": n} for n, f in zip(names, files, strict=True)]
    for entry in entries:
        _chunks(entry)  # a writer bug must not publish a manifest no load can use
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "committed_at": time.time(),
        "files": entries,
        "meta": meta,
    }
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()  # fails on bad meta, before writing

    with ThreadPoolExecutor(max_workers=8) as pool:
        present = list(pool.map(lambda n: storage.exists(_join(folder, n)), names))
    missing = [n for n, ok in zip(names, present, strict=True) if not ok]
    if missing:
        raise FileNotFoundError(
            f"cannot commit checkpoint iteration {iteration} in {_where(storage, job_root)}: "
            f"{len(missing)} file(s) not in storage: {', '.join(missing)}"
        )

    storage.put_bytes(_join(folder, MANIFEST), data)
    storage.put_bytes(_join(check_key(job_root, allow_empty=True), LATEST), f"{iteration}\n".encode())
    logger.info("committed checkpoint iteration %d in %s", iteration, _where(storage, job_root))
    if keep is not None:
        apply_retention(storage, job_root, keep)


def delete_iteration(storage: Storage, job_root: str, iteration: int) -> None:
    """Remove one iteration's folder, committed or not: manifest first."""
    folder = iteration_key(job_root, iteration)
    storage.delete(_join(folder, MANIFEST))  # uncommit first: a crash below leaves only debris
    storage.delete_prefix(folder)


def apply_retention(storage: Storage, job_root: str, keep: int) -> None:
    """Keep the newest `keep` committed checkpoints and the one `latest` names; delete older ones
    and uncommitted folders older than the latest checkpoint (never newer: a save may be in flight)."""
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive int, got {keep!r}")
    folders = _iter_folders(storage, job_root)
    committed = sorted(it for it, ok in folders.items() if ok)
    latest = latest_checkpoint(storage, job_root)
    if latest is None:
        return  # nothing committed: every folder may still be a save in progress
    kept = set(committed[-keep:]) | {latest}
    doomed = [it for it in committed if it not in kept]
    debris = [it for it, ok in folders.items() if not ok and it < latest]
    for it in sorted(doomed + debris):
        logger.info(
            "retention: deleting %s checkpoint iteration %d in %s",
            "committed" if folders[it] else "uncommitted",
            it,
            _where(storage, job_root),
        )
        delete_iteration(storage, job_root, it)


def read_manifest(storage: Storage, job_root: str, iteration: int) -> dict[str, Any]:
    """The parsed manifest of a committed checkpoint; FileNotFoundError if it is not committed."""
    key = _join(iteration_key(job_root, iteration), MANIFEST)
    try:
        raw = storage.get_bytes(key)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"checkpoint iteration {iteration} in {_where(storage, job_root)} is not committed (no {MANIFEST})"
        ) from None
    manifest = json.loads(raw)
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("format_version"), int):
        raise ValueError(f"{storage.uri}/{key} is not an elastron checkpoint manifest")
    if manifest["format_version"] > FORMAT_VERSION:
        raise ValueError(
            f"{storage.uri}/{key} has format version {manifest['format_version']}, newer than this "
            f"elastron reads ({FORMAT_VERSION}): upgrade elastron to load it"
        )
    return manifest


def _check_local(path: Path, entry: dict[str, Any]) -> str | None:
    """Why `path` does not match its manifest entry (read whole), or None if it does."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"size {size} bytes, manifest says {entry['size']}"
    if "sha256" in entry:  # format 1
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            return f"sha256 {digest[:12]}..., manifest says {entry['sha256'][:12]}..."
        return None
    buf = memoryview(bytearray(8 * 1024 * 1024))  # one buffer reused: shards and chunks can be GiB
    with open(path, "rb", buffering=0) as f:
        for offset, length, digest in _chunks(entry):
            crc, left = 0, length
            while left:
                n = f.readinto(buf[: min(left, len(buf))])
                if not n:
                    return f"ends before byte {offset + length}"
                crc, left = zlib.crc32(buf[:n], crc), left - n
            if f"{crc:08x}" != digest:
                return (
                    f"{CHECKSUM} of bytes {offset}-{offset + length - 1} is {crc:08x}, manifest says {digest}"
                )
    return None


def corrupt_error(
    storage: Storage, job_root: str, iteration: int, bad: list[tuple[str, str]]
) -> CheckpointCorruptError:
    """The error for a checkpoint whose files `bad` = [(name, why)] do not match its manifest,
    naming the previous committed checkpoint as the way out."""
    bad = sorted(dict(bad).items())  # one reason per file, the same on every rank
    try:
        previous = max((it for it in committed_iterations(storage, job_root) if it < iteration), default=None)
    except Exception:  # the listing failing must not hide the corruption report
        previous = None
    fallback = (
        f"The previous committed checkpoint, iteration {previous} "
        f"({iteration_key(job_root, previous)}), can be used instead."
        if previous is not None
        else "There is no previous committed checkpoint to use instead."
    )
    details = "; ".join(f"shard {name!r}: {why}" for name, why in bad)
    return CheckpointCorruptError(
        f"checkpoint iteration {iteration} in {_where(storage, job_root)} is corrupt: {details}. {fallback}",
        iteration=iteration,
        files=[name for name, _ in bad],
        previous=previous,
    )


def fetch_checkpoint(storage: Storage, job_root: str, iteration: int, cache_dir: Path) -> Path:
    """A local folder with every file of a committed checkpoint, each verified against the manifest.

    Local storage: the checkpoint's own folder (no copy). Remote: `cache_dir/<job_root>/iter_N`;
    files already there with the right size and sha256 are not downloaded again.
    Raises CheckpointCorruptError naming every bad file, and the previous committed checkpoint.
    """
    manifest = read_manifest(storage, job_root, iteration)
    folder = iteration_key(job_root, iteration)
    entries = manifest["files"]
    for entry in entries:
        check_key(entry["name"])  # a manifest must not send files outside the folder

    in_place = storage.local_path(folder)
    target = in_place if in_place is not None else Path(cache_dir) / folder

    def get(entry: dict[str, Any]) -> tuple[str, str | None]:
        path = target / entry["name"]
        if in_place is None and _check_local(path, entry) is not None:
            try:
                storage.get_file(_join(folder, entry["name"]), path)
            except FileNotFoundError:
                return entry["name"], "missing from storage"
        problem = _check_local(path, entry)
        if problem is not None and in_place is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # never leave a bad copy in the cache
        return entry["name"], problem

    with ThreadPoolExecutor(max_workers=min(4, max(1, len(entries)))) as pool:
        results = list(pool.map(get, entries))
    bad = [(name, why) for name, why in results if why is not None]
    if bad:
        raise corrupt_error(storage, job_root, iteration, bad)
    return target


@dataclass
class OpenCheckpoint:
    """A committed checkpoint (iteration `iteration` under `job_root` of `source`), ready to read.

    Its files are under the key `folder` of `storage`: `source` itself, or a local cache holding
    verified copies. `verify_on_read`: the reader must check every byte it reads against the
    chunk checksums of `files` (the manifest's entries).
    """

    source: Storage
    job_root: str
    iteration: int
    meta: dict[str, Any]
    storage: Storage
    folder: str
    verify_on_read: bool
    _files: list[dict[str, Any]] | None = None

    @property
    def files(self) -> list[dict[str, Any]]:
        if self._files is None:
            self._files = read_manifest(self.source, self.job_root, self.iteration)["files"]
        return self._files

    def __getstate__(self) -> dict[str, Any]:
        # A manifest holds a checksum per stored tensor: too big to all-gather to every rank
        # (all_gather_object pads every rank's object to the largest). A receiver re-reads it.
        return {**self.__dict__, "_files": None}


def open_checkpoint(
    storage: Storage, job_root: str, iteration: int, cache_dir: Path, *, check_now: Collection[str] = ()
) -> OpenCheckpoint:
    """Check a committed checkpoint as far as can be done before reading it, and say how to read it.

    Format 2 (chunk checksums): one listing shows every file present with its size; the files in
    `check_now` are read and verified now (DCP's `.metadata`, which DCP unpickles before a reader
    could check it); every other byte is verified by the reader as it reads it, straight from
    `storage`: nothing is downloaded or read twice. Format 1 (sha256 of whole files): the files
    are verified whole first, in place or fetched into `cache_dir` (`fetch_checkpoint`).
    Raises CheckpointCorruptError naming every bad file, and the previous committed checkpoint.
    """
    manifest = read_manifest(storage, job_root, iteration)
    folder = iteration_key(job_root, iteration)
    entries = manifest["files"]
    for entry in entries:
        check_key(entry["name"])  # a manifest must not send reads outside the folder
    if any("chunks" not in entry for entry in entries):
        fetch_checkpoint(storage, job_root, iteration, cache_dir)
        local = storage if storage.local_path(folder) is not None else LocalStorage(Path(cache_dir))
        return OpenCheckpoint(storage, job_root, iteration, manifest["meta"], local, folder, False, entries)

    sizes = storage.sizes(folder)
    bad = []
    for entry in entries:
        name, size = entry["name"], sizes.get(_join(folder, entry["name"]))
        if size is None:
            bad.append((name, "missing from storage"))
        elif size != entry["size"]:
            bad.append((name, f"size {size} bytes, manifest says {entry['size']}"))
        elif name in check_now:
            try:
                problem = Checksums(entry).problem(0, storage.get_bytes(_join(folder, name)))
            except FileNotFoundError:
                problem = "missing from storage"
            if problem is not None:
                bad.append((name, problem))
    if bad:
        raise corrupt_error(storage, job_root, iteration, bad)
    return OpenCheckpoint(storage, job_root, iteration, manifest["meta"], storage, folder, True, entries)


def resolve_checkpoint(storage: Storage, key: str) -> tuple[str, int] | None:
    """(job_root, iteration) for a job root (its latest committed checkpoint) or an iter_ folder key.

    None if a job root has nothing committed; ValueError if an iter_ folder has no manifest.
    """
    key = check_key(key, allow_empty=True)
    parent, _, last = key.rpartition("/")
    m = ITERATION_FOLDER.match(last)
    if m is not None:
        iteration = int(m.group(1))
        if not storage.exists(_join(key, MANIFEST)):
            raise ValueError(
                f"{_where(storage, key)} has no {MANIFEST}: it is an incomplete (crashed or in-flight) save, "
                f"not a committed checkpoint; name the job root {_where(storage, parent)!r} to take its newest "
                f"committed checkpoint"
            )
        return parent, iteration
    latest = latest_checkpoint(storage, key)
    return None if latest is None else (key, latest)
