"""RNG streams that make dropout right under tensor parallelism.

Replicated activations (the same on every TP rank) must get the same dropout mask on every TP
rank, so they use the default stream, seeded identically across TP. Sharded activations
(attention heads split over TP, sequence chunks under sequence parallelism) must get different
masks per rank, so they run inside `get_rng_tracker().fork()`, a stream seeded per TP rank.
Seeds follow Megatron-Core: default = seed + 100 * pp_rank, TP stream = that + 2718 + tp_rank,
expert stream = that + 1024 + 100 * ep_rank + etp_rank. State swapping goes through
engine.device so CPU and CUDA behave the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from engine import device
from engine import parallel_state as ps

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"


class RNGStatesTracker:
    """Named RNG states; `fork(name)` runs a block on that stream and restores the default."""

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} already used by another RNG state")
        saved = device.get_rng_state()
        device.manual_seed(seed)
        self._states[name] = device.get_rng_state()
        device.set_rng_state(saved)
        self._seeds.add(seed)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was never added: call model_parallel_manual_seed first")
        saved = device.get_rng_state()
        device.set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = device.get_rng_state()
            device.set_rng_state(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default stream and the TP / expert streams for this rank's grid position."""
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    device.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + ps.get_tensor_model_parallel_rank())
    if ps.model_parallel_is_initialized():
        expert_seed = seed + 1024 + 100 * ps.get_rank_in("ep") + ps.get_rank_in("etp")
    else:
        expert_seed = seed + 1024
    _TRACKER.add(EXPERT_PARALLEL_RNG, expert_seed)
