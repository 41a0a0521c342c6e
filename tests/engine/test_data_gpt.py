"""GPT samples over an indexed dataset: windows across documents, per-epoch shuffles, the cached index."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine.data.gpt_dataset import GPTDataset
from engine.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from engine.data.sources import micro_batch

E = 99  # the end-of-document id of these hand-built datasets


def write(prefix, docs, vocab_size=100) -> IndexedDataset:
    with IndexedDatasetWriter(prefix, vocab_size) as w:
        for d in docs:
            w.add_document(d)
    return IndexedDataset(prefix)


def samples(ds: GPTDataset, indices) -> list[list[int]]:
    return [ds[i].tolist() for i in indices]


def test_samples_run_across_document_boundaries(tmp_path):
    # Two documents, 7 tokens; seq_length 2: (7 - 1) // 2 = 3 samples of 3 tokens per epoch.
    a, b = [1, 2, 3, E], [4, 5, E]
    ds = GPTDataset(write(tmp_path / "ds", [a, b]), seq_length=2, seed=0)
    assert len(ds) == 3
    expected = {  # by document order; the last token of the epoch is left over
        (0, 1): [[1, 2, 3], [3, E, 4], [4, 5, E]],
        (1, 0): [[4, 5, E], [E, 1, 2], [2, 3, E]],
    }
    seen_orders = set()
    for epoch in range(6):
        got = samples(ds, range(3 * epoch, 3 * epoch + 3))
        order = tuple(int(d) for d in ds._epoch(epoch)[0])
        seen_orders.add(order)
        assert sorted(got) == sorted(expected[order]), (epoch, order, got)
        assert all(isinstance(s, list) and len(s) == 3 for s in got)
    assert seen_orders == {(0, 1), (1, 0)}  # documents are reshuffled per epoch
    assert ds[0].dtype == torch.long


def test_every_epoch_tiles_its_documents_once(tmp_path):
    rng = np.random.default_rng(1)
    docs = [list(rng.integers(0, E, rng.integers(1, 30))) + [E] for _ in range(40)]
    docs[5] = []  # an empty document is stepped over
    ds = GPTDataset(write(tmp_path / "ds", docs), seq_length=16, seed=3, num_samples=100)
    n = len(ds)
    assert n == (sum(map(len, docs)) - 1) // 16 and ds.num_epochs == -(-100 // n)
    for epoch in (0, 1, ds.num_epochs + 2):  # cached epochs and one built on demand
        order = [int(d) for d in ds._epoch(epoch)[0]]
        assert sorted(order) == list(range(40))
        stream = [t for d in order for t in docs[d]]
        want = sorted(stream[s * 16 : s * 16 + 17] for s in range(n))
        assert sorted(samples(ds, range(epoch * n, (epoch + 1) * n))) == want


def test_deterministic_for_a_seed_and_independent_of_the_planned_length(tmp_path):
    docs = [[i % 90] * (i % 7 + 1) + [E] for i in range(200)]
    indexed = write(tmp_path / "ds", docs)
    first = GPTDataset(indexed, 8, seed=5, num_samples=50, cache_dir=tmp_path / "c1")
    again = GPTDataset(indexed, 8, seed=5, num_samples=50, cache_dir=tmp_path / "c2")
    longer = GPTDataset(indexed, 8, seed=5, num_samples=5000, cache_dir=tmp_path / "c3")
    other = GPTDataset(indexed, 8, seed=6, num_samples=50, cache_dir=tmp_path / "c4")
    probe = [0, 1, 17, len(first) - 1, len(first), 3 * len(first) + 4, 4000]
    assert samples(first, probe) == samples(again, probe) == samples(longer, probe)
    assert samples(first, range(20)) != samples(other, range(20))
    with pytest.raises(IndexError):
        first[-1]


def test_the_index_is_cached_next_to_the_data_and_reused(tmp_path, monkeypatch):
    docs = [[i % 90] * 5 + [E] for i in range(100)]
    indexed = write(tmp_path / "ds", docs)
    built = GPTDataset(indexed, 8, seed=1, num_samples=300)
    assert not built.cache_hit
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ds.train."))
    assert len(files) == 4 and sum(f.endswith(".npy") for f in files) == 3  # + a readable description
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached index should have been loaded")

    monkeypatch.setattr(GPTDataset, "_build", no_rebuild)
    loaded = GPTDataset(IndexedDataset(tmp_path / "ds"), 8, seed=1, num_samples=300)
    assert loaded.cache_hit
    assert samples(loaded, range(len(loaded) * loaded.num_epochs)) == samples(
        built, range(len(built) * built.num_epochs)
    )
    # Another seed, length or split is another key: it is built, not loaded.
    for kwargs in ({"seed": 2}, {"num_samples": 301}, {"split": "valid"}):
        with pytest.raises(AssertionError, match="should have been loaded"):
            GPTDataset(indexed, 8, **{"seed": 1, "num_samples": 300, **kwargs})


def test_ranks_building_the_same_index_at_once_agree(tmp_path):
    indexed = write(tmp_path / "ds", [[i % 90] * 9 + [E] for i in range(300)])
    results: list = [None] * 4
    barrier = threading.Barrier(4)

    def rank(r):
        barrier.wait()
        results[r] = samples(GPTDataset(indexed, 8, seed=9, num_samples=1000), range(0, 1000, 7))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == results[0] for r in results)
    assert GPTDataset(indexed, 8, seed=9, num_samples=1000).cache_hit
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_a_read_only_data_folder_still_trains(tmp_path, caplog):
    indexed = write(tmp_path / "ds", [[1, 2, 3, E]] * 10)
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    ds = GPTDataset(indexed, 4, seed=0, cache_dir=blocked / "sub")
    assert len(ds[0]) == 5 and "data.cache_dir" in caplog.text


def test_a_split_samples_only_its_documents(tmp_path):
    docs = [[d] * 6 + [E] for d in range(10)]  # document d holds the id d
    ds = GPTDataset(write(tmp_path / "ds", docs), 4, seed=0, doc_range=(6, 9), split="valid")
    ids = {t for i in range(3 * len(ds)) for t in ds[i].tolist()}
    assert ids == {6, 7, 8, E}


def test_too_little_data_names_the_fields(tmp_path):
    indexed = write(tmp_path / "ds", [[1, 2, E]])
    with pytest.raises(ValueError, match=r"test split .* 3 tokens .* fewer than model\.seq_length \+ 1 = 5"):
        GPTDataset(indexed, 4, seed=0, split="test")


def test_micro_batches_read_by_global_index(tmp_path):
    ds = GPTDataset(write(tmp_path / "ds", [list(range(i, i + 20)) + [E] for i in range(30)]), 8, seed=0)
    tokens, labels = micro_batch(
        ds, consumed_samples=12, microbatch=1, micro_batch_size=2, dp_size=2, dp_rank=1
    )
    rows = torch.stack([ds[12 + 4 + 2], ds[12 + 4 + 3]])
    assert torch.equal(tokens, rows[:, :-1]) and torch.equal(labels, rows[:, 1:])
