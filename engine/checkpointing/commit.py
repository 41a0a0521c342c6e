"""The checkpoint commit protocol: when a checkpoint counts as saved, which one to resume from.

Layout under a job root key R (any `Storage`, local or S3)::

    R/iter_0000010/<shard files>     written first, by every rank (DCP's files, uploaded)
    R/iter_0000010/manifest.json     written LAST, by one rank: names, sizes, sha256 of every file
    R/latest                         text: the iteration number of the newest commit

Why the manifest goes last: ranks die mid-save (node loss, preemption, OOM) and Ray reports are
at-least-once, so a storage folder full of shard files proves nothing. A reader only ever trusts a
folder whose manifest exists, and the manifest is written (atomically) only after every file it
lists is already in storage; so "manifest visible" implies "checkpoint complete". `latest` is a
hint written after the manifest: if it points at a folder without a manifest, readers fall back to
the newest committed folder. Deleting runs in the opposite order (manifest first), so a deletion
that dies half way leaves an uncommitted folder, never a committed one with holes.

The manifest also carries each file's size and sha256, and `fetch_checkpoint` checks them: a shard
that was truncated, bit-flipped or deleted after the commit is reported by name, with the previous
committed checkpoint named as the way out, instead of failing deep inside DCP's load.

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
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.checkpointing.storage import Storage, check_key

logger = logging.getLogger(__name__)

FORMAT = "elastron-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


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


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: `name` relative to the iteration folder ('/'-separated)."""

    name: str
    size: int
    sha256: str


def sha256_file(path: Path | str, *, chunk_size: int = 4 * 1024 * 1024) -> str:
    """Hex sha256 of a file, read in chunks (shards can be many GiB)."""
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
    return _join(check_key(job_root, allow_empty=True), f"iter_{iteration:07d}")


def _where(storage: Storage, job_root: str) -> str:
    return f"{storage.uri.rstrip('/')}/{job_root}" if job_root else storage.uri


def _iter_folders(storage: Storage, job_root: str) -> dict[int, bool]:
    """iteration -> whether its folder has a manifest, for every iter_ folder directly under job_root."""
    root = check_key(job_root, allow_empty=True)
    cut = len(root) + 1 if root else 0
    found: dict[int, bool] = {}
    for key in storage.list(root):
        folder, _, rest = key[cut:].partition("/")
        m = _ITER_DIR.match(folder)
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
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "committed_at": time.time(),
        "files": [
            asdict(FileEntry(n, int(f.size), str(f.sha256))) for n, f in zip(names, files, strict=True)
        ],
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
    """Why `path` does not match its manifest entry, or None if it does."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"size {size} bytes, manifest says {entry['size']}"
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        return f"sha256 {digest[:12]}..., manifest says {entry['sha256'][:12]}..."
    return None


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
        try:
            previous = max(
                (it for it in committed_iterations(storage, job_root) if it < iteration), default=None
            )
        except Exception:  # the listing failing must not hide the corruption report
            previous = None
        fallback = (
            f"The previous committed checkpoint, iteration {previous} "
            f"({iteration_key(job_root, previous)}), can be used instead."
            if previous is not None
            else "There is no previous committed checkpoint to use instead."
        )
        details = "; ".join(f"shard {name!r}: {why}" for name, why in bad)
        raise CheckpointCorruptError(
            f"checkpoint iteration {iteration} in {_where(storage, job_root)} is corrupt: {details}. {fallback}",
            iteration=iteration,
            files=[name for name, _ in bad],
            previous=previous,
        )
    return target


def resolve_checkpoint(storage: Storage, key: str) -> tuple[str, int] | None:
    """(job_root, iteration) for a job root (its latest committed checkpoint) or an iter_ folder key.

    None if a job root has nothing committed; ValueError if an iter_ folder has no manifest.
    """
    key = check_key(key, allow_empty=True)
    parent, _, last = key.rpartition("/")
    m = _ITER_DIR.match(last)
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
