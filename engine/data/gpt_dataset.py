"""GPT samples: fixed windows of seq_length + 1 tokens over a run of documents, reshuffled per epoch.

A sample is the inputs plus the next-token labels (seq_length + 1 ids); it runs across document
boundaries, the EOD ids that preprocess appended marking them, so no token is padding.

Epoch e of a split (documents [start, end) of an indexed dataset) is built on its own:
  doc_idx     the split's documents in a seeded random order,
  sample_idx  where sample s starts in that order: (position in doc_idx, offset in that document);
              sample s covers tokens s*seq_length .. (s+1)*seq_length of the concatenation,
  shuffle_idx the order in which the epoch's samples are served.
Every epoch has the same number of samples, (tokens - 1) // seq_length (the few tokens left over
are dropped, a different few each epoch), and depends only on (seed, epoch). So global sample i is
sample i mod n of epoch i // n whatever the requested length of the run: resuming after a change
of train_iters, or reading past the planned number of samples, gives the same data.

The epochs that `num_samples` needs are built once and cached as .npy files next to the data (or
in `cache_dir`), named by a hash of seed, seq_length, num_samples, the split and the lengths of
its documents. Every rank may build them at the same time: each writes a temporary file and
renames it into place, and a rename is atomic, so a reader sees a whole file or none. Epochs
past the cached ones are built in memory when first read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from pathlib import Path

import numpy as np
import torch

from engine.data.indexed_dataset import IndexedDataset
from engine.data.sources import TokenSource

log = logging.getLogger(__name__)

_INDEX_VERSION = 1
_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


class GPTDataset(TokenSource):
    """Samples over documents `doc_range` of `indexed`; `ds[i]` for any i >= 0, len(ds) = samples per epoch."""

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_length: int,
        seed: int,
        *,
        doc_range: tuple[int, int] | None = None,
        num_samples: int | None = None,
        split: str = "train",
        cache_dir: str | Path | None = None,
    ):
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.indexed, self.seq_length, self.seed, self.split = indexed, seq_length, seed, split
        start, end = doc_range if doc_range is not None else (0, len(indexed))
        if not 0 <= start < end <= len(indexed):
            raise ValueError(f"document range [{start}, {end}) is empty or outside 0..{len(indexed)}")
        self.doc_range = (start, end)
        self.doc_lengths = np.diff(np.asarray(indexed.offsets[start : end + 1]))
        self.num_tokens = int(self.doc_lengths.sum())
        self.samples_per_epoch = (self.num_tokens - 1) // seq_length
        if self.samples_per_epoch < 1:
            where = f"{indexed.prefix}" if indexed.prefix is not None else "the dataset"
            raise ValueError(
                f"the {split} split of {where} has {self.num_tokens} tokens ({end - start} documents): "
                f"fewer than model.seq_length + 1 = {seq_length + 1}; give it more data (data.split) "
                "or shorten model.seq_length"
            )
        self.num_samples = num_samples if num_samples is not None else self.samples_per_epoch
        self.num_epochs = max(1, -(-self.num_samples // self.samples_per_epoch))
        self.cache_hit = False
        self.cache_paths = self._cache_paths(cache_dir)
        arrays = self._load_cache()
        if arrays is None:
            arrays = self._build(range(self.num_epochs))
            self._save_cache(arrays)
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays
        self._extra: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return self.samples_per_epoch

    def __getitem__(self, index: int) -> torch.Tensor:
        index = int(index)
        if index < 0:
            raise IndexError(f"sample index must be non-negative, got {index}")
        epoch, i = divmod(index, self.samples_per_epoch)
        doc_idx, sample_idx, shuffle_idx = self._epoch(epoch)
        pos, offset = (int(x) for x in sample_idx[shuffle_idx[i]])
        need, parts = self.seq_length + 1, []
        offsets, tokens = self.indexed.offsets, self.indexed.tokens
        while need:
            doc = int(doc_idx[pos])
            begin = int(offsets[doc]) + offset
            take = min(int(offsets[doc + 1]) - begin, need)
            parts.append(tokens[begin : begin + take])
            need, pos, offset = need - take, pos + 1, 0
        return torch.from_numpy(np.concatenate(parts).astype(np.int64))

    # -- the per-epoch index -------------------------------------------------------------------

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if epoch < self.num_epochs:
            return self.doc_idx[epoch], self.sample_idx[epoch], self.shuffle_idx[epoch]
        if epoch not in self._extra:
            if len(self._extra) >= 2:  # reads move forward: keep the newest epochs only
                self._extra.pop(min(self._extra))
            doc, sample, shuffle = self._build([epoch])
            self._extra[epoch] = (doc[0], sample[0], shuffle[0])
        return self._extra[epoch]

    def _build(self, epochs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The three index arrays for `epochs`, stacked: [epochs, docs], [epochs, n, 2], [epochs, n]."""
        start, _ = self.doc_range
        docs, n = len(self.doc_lengths), self.samples_per_epoch
        doc_idx = np.empty((len(epochs), docs), dtype=np.int64)
        sample_idx = np.empty((len(epochs), n, 2), dtype=np.int64)
        shuffle_idx = np.empty((len(epochs), n), dtype=np.int64)
        positions = np.arange(n, dtype=np.int64) * self.seq_length
        for row, epoch in enumerate(epochs):
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            order = rng.permutation(docs)
            ends = np.cumsum(self.doc_lengths[order])
            # The document holding token p is the first whose end lies past p (empty ones never are).
            where = np.searchsorted(ends, positions, side="right")
            doc_idx[row] = order + start
            sample_idx[row, :, 0] = where
            sample_idx[row, :, 1] = positions - (ends[where] - self.doc_lengths[order][where])
            shuffle_idx[row] = rng.permutation(n)
        return doc_idx, sample_idx, shuffle_idx

    # -- the on-disk cache ---------------------------------------------------------------------

    def _description(self) -> dict:
        return {
            "version": _INDEX_VERSION,
            "seed": self.seed,
            "seq_length": self.seq_length,
            "num_samples": self.num_samples,
            "split": self.split,
            "doc_range": list(self.doc_range),
            "dataset_docs": len(self.indexed),
            "dataset_tokens": self.indexed.num_tokens,
            # The index depends on the split's document lengths and nothing else of the data:
            # their digest keys it, so re-preprocessed data never reuses a stale index.
            "doc_lengths_blake2b": hashlib.blake2b(self.doc_lengths.tobytes(), digest_size=16).hexdigest(),
        }

    def _cache_paths(self, cache_dir: str | Path | None) -> dict[str, Path] | None:
        prefix = self.indexed.prefix
        if prefix is None and cache_dir is None:
            return None  # an in-memory dataset: nothing on disk to sit next to
        folder = Path(cache_dir) if cache_dir is not None else prefix.parent
        stem = prefix.name if prefix is not None else "dataset"
        key = hashlib.sha256(json.dumps(self._description(), sort_keys=True).encode()).hexdigest()[:16]
        base = f"{stem}.{self.split}.{key}"
        paths = {name: folder / f"{base}.{name}.npy" for name in _NAMES}
        paths["description"] = folder / f"{base}.json"
        return paths

    def _load_cache(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if self.cache_paths is None or not all(self.cache_paths[n].is_file() for n in _NAMES):
            return None
        try:
            arrays = tuple(np.load(self.cache_paths[n], mmap_mode="r") for n in _NAMES)
        except (OSError, ValueError) as err:
            log.warning("sample index cache %s unreadable (%s): rebuilding", self.cache_paths["doc_idx"], err)
            return None
        e, n, d = self.num_epochs, self.samples_per_epoch, len(self.doc_lengths)
        if [a.shape for a in arrays] != [(e, d), (e, n, 2), (e, n)]:
            log.warning(
                "sample index cache %s has unexpected shapes: rebuilding", self.cache_paths["doc_idx"]
            )
            return None
        self.cache_hit = True
        return arrays

    def _save_cache(self, arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        if self.cache_paths is None:
            return
        try:
            self.cache_paths["doc_idx"].parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.cache_paths["description"], json.dumps(self._description(), indent=1).encode())
            for name, array in zip(_NAMES, arrays, strict=True):
                _save_npy_atomic(self.cache_paths[name], array)
        except OSError as err:  # a read-only data folder: train anyway, from the index in memory
            log.warning(
                "cannot cache the sample index next to the data (%s); set data.cache_dir to a writable "
                "folder to reuse it across runs",
                err,
            )


def _tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp{os.getpid()}.{uuid.uuid4().hex[:8]}")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = _tmp_name(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
