"""The memory-mapped indexed dataset: format, dtype choice, round trips, atomic writes, clear errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from engine.data.indexed_dataset import (
    HEADER_SIZE,
    MAGIC,
    IndexedDataset,
    IndexedDatasetWriter,
    dtype_for_vocab,
)


def random_docs(rng, vocab_size: int, n: int = 50) -> list[np.ndarray]:
    docs = [rng.integers(0, vocab_size, rng.integers(0, 40)) for _ in range(n)]
    docs[3] = np.zeros(0, dtype=np.int64)  # an empty document survives the round trip
    return docs


def write(prefix, docs, vocab_size):
    with IndexedDatasetWriter(prefix, vocab_size) as w:
        for d in docs:
            w.add_document(d)
    return IndexedDataset(prefix)


@pytest.mark.parametrize(
    "vocab_size, dtype", [(257, np.uint16), (65535, np.uint16), (65536, np.int32), (150_000, np.int32)]
)
def test_dtype_follows_the_vocabulary(vocab_size, dtype):
    assert dtype_for_vocab(vocab_size) == np.dtype(dtype)


@pytest.mark.parametrize("vocab_size", [257, 65535, 150_000])
def test_round_trip(tmp_path, vocab_size):
    docs = random_docs(np.random.default_rng(vocab_size), vocab_size)
    docs[0] = np.array([0, vocab_size - 1])  # both ends of the id range
    ds = write(tmp_path / "ds", docs, vocab_size)
    assert ds.dtype == dtype_for_vocab(vocab_size)
    assert len(ds) == len(docs) and ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        assert ds[i].tolist() == list(d)
    assert ds[-1].tolist() == list(docs[-1])
    assert ds.doc_lengths.tolist() == [len(d) for d in docs]
    assert (tmp_path / "ds.bin").stat().st_size == ds.num_tokens * ds.dtype.itemsize
    assert isinstance(ds.tokens, np.memmap)
    with pytest.raises(IndexError):
        ds[len(docs)]


def test_header_layout(tmp_path):
    write(tmp_path / "ds", [[1, 2, 3], [4]], 70_000)
    raw = (tmp_path / "ds.idx").read_bytes()
    magic, version, code, docs = struct.unpack("<8sIB3xQ", raw[:HEADER_SIZE])
    assert (magic, version, code, docs) == (MAGIC, 1, 2, 2)
    assert np.frombuffer(raw[HEADER_SIZE:], np.int64).tolist() == [0, 3, 4]
    assert np.frombuffer((tmp_path / "ds.bin").read_bytes(), np.int32).tolist() == [1, 2, 3, 4]


def test_batched_appends_and_merging_match_one_by_one(tmp_path):
    rng = np.random.default_rng(0)
    docs = random_docs(rng, 1000)
    one = write(tmp_path / "one", docs, 1000)
    with IndexedDatasetWriter(tmp_path / "batched", 1000) as w:
        for chunk in (docs[:20], docs[20:]):
            w.add_documents(np.concatenate(chunk), [len(d) for d in chunk])
    write(tmp_path / "a", docs[:7], 1000)
    write(tmp_path / "b", docs[7:], 1000)
    with IndexedDatasetWriter(tmp_path / "merged", 1000) as w:
        w.add_dataset(tmp_path / "a")
        w.add_dataset(tmp_path / "b")
    for name in ("batched", "merged"):
        assert (tmp_path / f"{name}.bin").read_bytes() == (tmp_path / "one.bin").read_bytes()
        assert (tmp_path / f"{name}.idx").read_bytes() == (tmp_path / "one.idx").read_bytes()
    assert len(one) == len(docs)


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    with pytest.raises(ValueError, match=r"token id 300 is outside the vocabulary \[0, 257\)"):
        with IndexedDatasetWriter(tmp_path / "ds", 257) as w:
            w.add_document([1, 2])
            w.add_document([300])
    assert list(tmp_path.iterdir()) == []


def test_missing_and_damaged_files_are_clear_errors(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"no indexed dataset at .*nope: .*nope\.idx is missing.*elastron preprocess"
    ):
        IndexedDataset(tmp_path / "nope")
    write(tmp_path / "ds", [[1, 2, 3], [4, 5]], 257)
    bin_ = tmp_path / "ds.bin"
    bin_.write_bytes(bin_.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(tmp_path / "ds")
    (tmp_path / "ds.idx").write_bytes(b"GARBAGE!" + bytes(40))
    with pytest.raises(ValueError, match="not an elastron index file"):
        IndexedDataset(tmp_path / "ds")


def test_empty_dataset_and_in_memory_dataset(tmp_path):
    ds = write(tmp_path / "empty", [], 257)
    assert len(ds) == 0 and ds.num_tokens == 0
    mem = IndexedDataset.from_documents([[5, 6], [], [7]], 257)
    assert mem.prefix is None and mem.dtype == np.uint16
    assert [mem[i].tolist() for i in range(3)] == [[5, 6], [], [7]]
