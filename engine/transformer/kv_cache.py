"""The keys and values of tokens already read, kept for greedy decoding (engine/harness).

Each row of a batch has its own length: a step feeds every row `w` tokens starting at that row's
own position (`starts`), writes their keys and values there, and each query attends the cached
keys at positions up to its own. Positions past a row's end may hold anything (a prefill padded
to a common width, or the pad tokens that keep a decode step divisible by TP under sequence
parallelism): no query attends them before a real token has overwritten them, since a query at
position p sees keys 0..p only. So right padding needs no attention mask of its own, as in
training.

The cache holds this rank's query groups only (attention splits over TP by whole groups), one
[b, groups, max_len, head_dim] buffer pair per layer of this rank's stage. Megatron-Core calls
the same object its inference context; here the model receives it as `kv_cache` and nothing
else in the model changes.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, rows: int, max_len: int, device: torch.device):
        self.max_len = max_len
        self.starts = torch.zeros(rows, dtype=torch.long, device=device)
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def positions(self, width: int) -> torch.Tensor:
        """[b, width]: every fed token's position in its row."""
        pos = self.starts[:, None] + torch.arange(width, device=self.starts.device)
        if int(pos.max()) >= self.max_len:
            raise ValueError(f"a row would pass the cache's {self.max_len} positions")
        return pos

    def attention_mask(self, width: int) -> torch.Tensor:
        """[b, 1, width, max_len] bool, True = attend: a query sees the cached keys at its own
        position and before."""
        keys = torch.arange(self.max_len, device=self.starts.device)
        return (keys[None, None, :] <= self.positions(width)[:, :, None]).unsqueeze(1)

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)


class LayerCache:
    """One layer's view: `update(k, v)` writes the step's keys and values [b, groups, w, d] at
    their positions and returns the layer's whole cache [b, groups, max_len, d]."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache
        if self.index not in cache._layers:
            b, groups, _, d = k.shape
            cache._layers[self.index] = tuple(
                torch.zeros(b, groups, cache.max_len, d, dtype=k.dtype, device=k.device) for _ in range(2)
            )
        keys, values = cache._layers[self.index]
        pos = cache.positions(k.shape[2])  # [b, w]
        index = pos[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        keys.scatter_(2, index, k)
        values.scatter_(2, index, v)
        return keys, values
