"""Blending datasets by weight, and cutting a dataset's documents into train/valid/test.

Blending follows Megatron-Core's greedy rule: sample i goes to the dataset whose achieved count
lags its target most, i.e. the d maximising weight_d * (i + 1) - count_d (ties to the lowest d).
Unlike drawing at random, every prefix of the run then holds each dataset in its exact share:
after N samples, count_d is within one sample of weight_d * N. The choice depends on nothing but
the weights, so every rank computes the same sequence with no communication.

The sequence is built lazily, in growing chunks, as far as the highest index read: blended sample
i is the same whatever the planned run length, and an index past the plan still works (each
dataset wraps into its next epoch). The loop is plain Python, about a microsecond per sample for
a few datasets, which is why it is extended on demand instead of built for the whole run up front.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from engine.data.sources import TokenSource


def normalize_weights(weights: Sequence[float]) -> list[float]:
    if len(weights) == 0 or any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"blend weights must be positive finite numbers, got {list(weights)}")
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def greedy_blend(
    weights: Sequence[float], size: int, counts: Sequence[int] | None = None, start: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Samples start..start+size-1 of the blend: (dataset of each, its index within that dataset).

    `counts` are the samples each dataset has had before `start` (all zero for start = 0), so the
    sequence can be extended chunk by chunk with exactly the result of one long build.
    """
    w = normalize_weights(weights)
    c = list(counts) if counts is not None else [0] * len(w)
    k = len(w)
    which = np.empty(size, dtype=np.int32)
    within = np.empty(size, dtype=np.int64)
    for n in range(size):
        t = start + n + 1
        best, best_lag = 0, w[0] * t - c[0]
        for d in range(1, k):
            lag = w[d] * t - c[d]
            if lag > best_lag:
                best, best_lag = d, lag
        which[n], within[n] = best, c[best]
        c[best] += 1
    return which, within


class BlendedDataset(TokenSource):
    """`ds[i]` = sample `dataset_sample_index[i]` of dataset `dataset_index[i]`; any i >= 0 works.

    len(ds) is `size` when given (the planned number of samples), else the components' total.
    """

    _MIN_CHUNK = 4096

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int | None = None):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = size if size is not None else sum(len(d) for d in self.datasets)
        self.dataset_index = np.empty(0, dtype=np.int32)
        self.dataset_sample_index = np.empty(0, dtype=np.int64)
        self._counts = [0] * len(self.datasets)

    def __len__(self) -> int:
        return self.size

    def _extend(self, upto: int) -> None:
        built = len(self.dataset_index)
        if upto <= built:
            return
        grow = max(upto - built, built, self._MIN_CHUNK)
        which, within = greedy_blend(self.weights, grow, self._counts, start=built)
        self._counts = list(np.bincount(which, minlength=len(self.datasets)) + np.asarray(self._counts))
        self.dataset_index = np.concatenate([self.dataset_index, which])
        self.dataset_sample_index = np.concatenate([self.dataset_sample_index, within])

    def __getitem__(self, index: int) -> torch.Tensor:
        index = int(index)
        if index < 0:
            raise IndexError(f"sample index must be non-negative, got {index}")
        self._extend(index + 1)
        return self.datasets[self.dataset_index[index]][int(self.dataset_sample_index[index])]


def split_doc_ranges(num_docs: int, ratios: Sequence[float]) -> list[tuple[int, int]]:
    """Consecutive document ranges for train/valid/test in proportion to `ratios` (any scale).

    "949,50,1" over 1000 documents gives [0, 949), [949, 999), [999, 1000). Boundaries are rounded
    to whole documents; a split whose share rounds to nothing gets an empty range.
    """
    if not ratios or any(r < 0 for r in ratios) or sum(ratios) <= 0:
        raise ValueError(f"data.split ratios must be non-negative with a positive sum, got {list(ratios)}")
    total = float(sum(ratios))
    bounds, acc = [0], 0.0
    for r in ratios:
        acc += r
        bounds.append(min(num_docs, round(acc / total * num_docs)))
    bounds[-1] = num_docs
    return [(bounds[i], bounds[i + 1]) for i in range(len(ratios))]
