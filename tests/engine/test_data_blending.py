"""Blending by exact greedy proportions, and train/valid/test splits by document ratio."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.data.blending import BlendedDataset, greedy_blend, split_doc_ranges


class Tagged:
    """A stand-in dataset: sample k of dataset d is [d, k]."""

    def __init__(self, d: int, n: int = 10):
        self.d, self.n = d, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> torch.Tensor:
        return torch.tensor([self.d, k])


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [5, 3, 1, 0.5], [0.01, 0.99], [2, 7, 11, 13, 17]])
@pytest.mark.parametrize("n", [1000, 12_345])
def test_counts_are_exact_up_to_rounding(weights, n):
    which, within = greedy_blend(weights, n)
    w = np.asarray(weights, dtype=float) / sum(weights)
    counts = np.bincount(which, minlength=len(w))
    assert counts.sum() == n
    assert np.all(np.abs(counts - np.round(w * n)) <= 1), (counts, w * n)
    # ... and not only at the end: every prefix of the run holds each dataset within one sample.
    running = np.cumsum(np.eye(len(w), dtype=np.int64)[which], axis=0)
    assert np.abs(running - np.outer(np.arange(1, n + 1), w)).max() < 1
    # The index within each dataset counts up: no sample of a dataset is used twice or skipped.
    for d in range(len(w)):
        assert within[which == d].tolist() == list(range(counts[d]))


def test_the_rule_is_largest_lag_first_with_ties_to_the_lowest():
    # Equal weights: the lags tie at every odd step and the lowest index goes first.
    assert greedy_blend([1, 1], 4)[0].tolist() == [0, 1, 0, 1]
    # weights 0.75/0.25: t=1 lags (.75, .25) -> a; t=2 (.5, .5) -> a (tie); t=3 (.25, .75) -> b; t=4 (1, 0) -> a
    assert greedy_blend([3, 1], 8)[0].tolist() == [0, 0, 1, 0, 0, 0, 1, 0]


def test_built_in_chunks_equals_built_at_once_and_reads_any_index():
    weights = [0.5, 0.3, 0.2]
    which, within = greedy_blend(weights, 20_000)
    blend = BlendedDataset([Tagged(d) for d in range(3)], weights, size=100)
    assert len(blend) == 100
    for i in [0, 5, 99, 100, 4095, 4096, 19_999, 12_000, 7]:  # past `size` too, in any order
        assert blend[i].tolist() == [int(which[i]), int(within[i])]
    assert np.array_equal(blend.dataset_index[:20_000], which)
    with pytest.raises(IndexError):
        blend[-1]


def test_bad_weights_are_refused():
    for bad in ([], [1, 0], [1, -2], [float("nan")]):
        with pytest.raises(ValueError, match="positive"):
            greedy_blend(bad, 3)


@pytest.mark.parametrize(
    "docs, ratios, expected",
    [
        (1000, [949, 50, 1], [(0, 949), (949, 999), (999, 1000)]),
        (100, [98, 1, 1], [(0, 98), (98, 99), (99, 100)]),
        (10, [1, 0, 0], [(0, 10), (10, 10), (10, 10)]),
        (10, [0.8, 0.2, 0], [(0, 8), (8, 10), (10, 10)]),
        (7, [1, 1, 1], [(0, 2), (2, 5), (5, 7)]),  # rounding: 2.33 -> 2, 4.67 -> 5
        (3, [98, 1, 1], [(0, 3), (3, 3), (3, 3)]),  # too few documents for valid/test
    ],
)
def test_split_by_document_ratio(docs, ratios, expected):
    ranges = split_doc_ranges(docs, ratios)
    assert ranges == expected
    assert ranges[0][0] == 0 and ranges[-1][1] == docs
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_split_refuses_negative_or_zero_ratios():
    with pytest.raises(ValueError, match="data.split"):
        split_doc_ranges(10, [1, -1, 0])
    with pytest.raises(ValueError, match="data.split"):
        split_doc_ranges(10, [0, 0, 0])
