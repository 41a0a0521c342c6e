"""Memory-mapped indexed dataset: PREFIX.bin holds token ids, PREFIX.idx where each document starts.

Why this layout: training reads a few thousand tokens at random places in a corpus that can be far
larger than memory. With the ids flat in one file and the document offsets in another, a reader
memory-maps both and the page cache does the rest; nothing is loaded or parsed at start.

PREFIX.bin  the token ids of every document, back to back, in the dataset's dtype (no header).
PREFIX.idx  a 24-byte little-endian header, then doc_count + 1 int64 offsets (in tokens) into .bin:
            document i is tokens[offsets[i]:offsets[i+1]].
              magic     8 bytes  b"ELXIDX\\x00\\x00"
              version   uint32   1
              dtype     uint8    1 = uint16, 2 = int32
              (padding  3 bytes)
              docs      uint64   document count

The dtype follows the vocabulary: uint16 when vocab_size <= 65535 (half the disk and page cache),
int32 above. The writer streams: tokens go straight to disk and offsets to a side file, so memory
stays flat whatever the corpus size; both files appear under their final names only when the
writer closes cleanly (write to temporaries, then rename), so a crash never leaves a dataset that
looks complete.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

MAGIC = b"ELXIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIB3xQ")
HEADER_SIZE = _HEADER.size  # 24: keeps the int64 offsets 8-byte aligned
DTYPE_CODES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}
_CODE_OF = {v: k for k, v in DTYPE_CODES.items()}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 holds every id of a vocabulary up to 65535 entries; larger ones need int32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.int32)


def data_file(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def index_file(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class IndexedDatasetWriter:
    """Append documents (or whole datasets) to a new PREFIX.bin/.idx; use as a context manager."""

    def __init__(self, prefix: str | Path, vocab_size: int):
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp{os.getpid()}"
        self._bin_tmp = Path(f"{data_file(prefix)}{tag}")
        self._off_tmp = Path(f"{index_file(prefix)}{tag}.offsets")
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 (closed in close/abort)
        self._off = open(self._off_tmp, "wb")  # noqa: SIM115
        self.num_docs = 0
        self.num_tokens = 0
        self._off.write(np.zeros(1, np.int64).tobytes())

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(
                f"token id {int(arr.max()) if arr.max() >= self.vocab_size else int(arr.min())} is outside "
                f"the vocabulary [0, {self.vocab_size}) given to the writer"
            )
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self.num_tokens += int(arr.size)
        self.num_docs += 1
        self._off.write(np.int64(self.num_tokens).tobytes())

    def add_documents(self, tokens: np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Many documents at once: `tokens` is their concatenation, `lengths` their sizes."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths add up to {int(lengths.sum())} but {tokens.size} tokens were given")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(
                f"a token id is outside the vocabulary [0, {self.vocab_size}) given to the writer"
            )
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._off.write((self.num_tokens + np.cumsum(lengths)).astype(np.int64).tobytes())
        self.num_tokens += int(tokens.size)
        self.num_docs += int(lengths.size)

    def add_dataset(self, prefix: str | Path) -> None:
        """Append every document of an existing dataset (merging shards), copying its bytes."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix} holds {other.dtype} ids but this dataset writes {self.dtype}")
        with open(data_file(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 1 << 24)
        self._off.write((self.num_tokens + np.asarray(other.offsets[1:])).astype(np.int64).tobytes())
        self.num_tokens += other.num_tokens
        self.num_docs += len(other)

    def close(self) -> None:
        """Finish the index and move both files to their final names (.bin first, .idx last)."""
        self._bin.close()
        self._off.close()
        idx_tmp = Path(f"{self._off_tmp}.idx")
        with open(idx_tmp, "wb") as out, open(self._off_tmp, "rb") as offsets:
            out.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], self.num_docs))
            shutil.copyfileobj(offsets, out, 1 << 24)
        self._off_tmp.unlink()
        os.replace(self._bin_tmp, data_file(self.prefix))
        os.replace(idx_tmp, index_file(self.prefix))

    def abort(self) -> None:
        for f in (self._bin, self._off):
            f.close()
        for p in (self._bin_tmp, self._off_tmp, Path(f"{self._off_tmp}.idx")):
            p.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of a dataset: `ds[i]` is document i's ids (a numpy view, nothing copied).

    Built from a PREFIX (memory-mapped files) or, with `from_arrays`, from arrays in memory (a text
    file tokenised at start-up goes through the same GPT sampling as a preprocessed corpus).
    """

    def __init__(self, prefix: str | Path):
        self.prefix: Path | None = Path(prefix)
        idx, bin_ = index_file(prefix), data_file(prefix)
        for f in (idx, bin_):
            if not f.is_file():
                raise FileNotFoundError(
                    f"no indexed dataset at {prefix}: {f} is missing (make one with "
                    f"`elastron preprocess --input FILES --output {prefix}`)"
                )
        with open(idx, "rb") as f:
            raw = f.read(HEADER_SIZE)
        if len(raw) < HEADER_SIZE:
            raise ValueError(
                f"{idx} is truncated: {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header"
            )
        magic, version, code, docs = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise ValueError(f"{idx} is not an elastron index file (magic {magic!r})")
        if version != VERSION:
            raise ValueError(f"{idx} has format version {version}; this elastron reads version {VERSION}")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx} has an unknown dtype code {code}")
        self.dtype = DTYPE_CODES[code]
        expected = HEADER_SIZE + 8 * (docs + 1)
        if idx.stat().st_size != expected:
            raise ValueError(f"{idx} is {idx.stat().st_size} bytes, expected {expected} for {docs} documents")
        self.offsets = np.memmap(idx, dtype=np.int64, mode="r", offset=HEADER_SIZE, shape=(docs + 1,))
        n_tokens = int(self.offsets[-1])
        if bin_.stat().st_size != n_tokens * self.dtype.itemsize:
            raise ValueError(
                f"{bin_} is {bin_.stat().st_size} bytes but {idx} lists {n_tokens} tokens of {self.dtype}: "
                "the pair is from different runs or truncated; preprocess again"
            )
        # np.memmap refuses an empty file; an empty dataset has nothing to map.
        self.tokens = (
            np.memmap(bin_, dtype=self.dtype, mode="r") if n_tokens else np.zeros(0, dtype=self.dtype)
        )

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, offsets: np.ndarray) -> IndexedDataset:
        self = cls.__new__(cls)
        self.prefix = None
        self.tokens, self.offsets = np.asarray(tokens), np.asarray(offsets, dtype=np.int64)
        self.dtype = self.tokens.dtype
        return self

    @classmethod
    def from_documents(cls, docs: Iterable[Sequence[int]], vocab_size: int) -> IndexedDataset:
        arrays = [np.asarray(d, dtype=dtype_for_vocab(vocab_size)) for d in docs]
        lengths = np.array([a.size for a in arrays], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype_for_vocab(vocab_size))
        return cls.from_arrays(tokens, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, doc: int) -> np.ndarray:
        if not -len(self) <= doc < len(self):
            raise IndexError(f"document {doc} out of range for {len(self)} documents")
        doc %= len(self)
        return self.tokens[self.offsets[doc] : self.offsets[doc + 1]]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)
