"""RNG streams that make dropout right under tensor parallelism.

Replicated activations (the same on every TP rank) must get the same dropout mask on every TP
rank, so they use the default stream, seeded identically across TP. Sharded activations
(attention heads split over TP, sequence chunks under sequence parallelism) must get different
masks per rank, so they run inside `get_rng_tracker().fork()`, a stream seeded per TP rank.
Seeds follow Megatron-Core: default = seed + 100 * pp_rank, TP stream = that + 2718 + tp_rank,
expert stream = that + 1024 + 100 * ep_rank + etp_rank. State swapping goes through
engine.device so CPU and CUDA behave the same.

`checkpoint` (activation recomputation) lives here because recomputing a block is only right if
it draws the same dropout masks as its forward did, on the default stream and on every tracker
stream alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

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


def capture_rng_state() -> dict[str, object]:
    """Every stream a step draws from (host, device default, tracker streams), to replay a step
    exactly: the rerun state machine re-executes an iteration from this."""
    return {"host": torch.get_rng_state(), "device": device.get_rng_state(), "tracker": _TRACKER.get_states()}


def restore_rng_state(state: dict[str, object]) -> None:
    torch.set_rng_state(state["host"])
    device.set_rng_state(state["device"])
    _TRACKER.set_states(state["tracker"])


def rng_state_dict() -> dict[str, torch.Tensor]:
    """The streams a checkpoint keeps per rank: the device default ("default") and the tracker's
    ("tracker.<name>"), under the keys checkpoints have always used (not the host stream, which
    they never held; `capture_rng_state` above, for a re-run in place, has it too)."""
    out = {"default": device.get_rng_state()}
    out.update({f"tracker.{name}": state for name, state in _TRACKER.get_states().items()})
    return out


def load_rng_state_dict(states: dict[str, torch.Tensor]) -> None:
    """Put back what `rng_state_dict` gave (of this rank's grid position: the caller knows)."""
    device.set_rng_state(states["default"])
    _TRACKER.set_states({k.removeprefix("tracker."): v for k, v in states.items() if k.startswith("tracker.")})


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


class _ForwardRNG:
    """Recompute context: run on the RNG states captured at forward time, then put back the
    states found on entry (the live, post-forward ones) so the rest of backward and later steps
    draw exactly what they would have drawn without recomputation. Re-enterable: a
    retain_graph backward recomputes again with the same states."""

    def __init__(self) -> None:
        self._default = device.get_rng_state()
        self._tracker = _TRACKER.get_states()
        self._saved: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []

    def __enter__(self) -> None:
        self._saved.append((device.get_rng_state(), _TRACKER.get_states()))
        device.set_rng_state(self._default)
        _TRACKER.set_states(self._tracker)

    def __exit__(self, *exc: object) -> None:
        default, tracker = self._saved.pop()
        device.set_rng_state(default)
        _TRACKER.set_states(tracker)


def _forward_rng_contexts() -> tuple[contextlib.AbstractContextManager, _ForwardRNG]:
    """`context_fn` for torch.utils.checkpoint, called as the checkpointed forward starts."""
    return contextlib.nullcontext(), _ForwardRNG()


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` without keeping its activations; backward recomputes it.

    Built on torch.utils.checkpoint (non-reentrant) rather than a hand-written autograd.Function
    (Megatron-Core's CheckpointFunction, the same design as torch's reentrant variant). That
    design detaches the inputs and runs a nested backward over the recomputed graph, so it needs
    special handling for non-tensor and structured arguments (the rotary (cos, sin) tuple, None),
    does not work with torch.autograd.grad, and always recomputes the whole function. The
    non-reentrant form takes any arguments, hooks in through saved-tensor hooks so the outer
    backward (and the parameter-gradient hooks the data-parallel reduction relies on) runs as
    usual, and stops recomputing once the tensors backward needs are back. The one thing it
    cannot know about is this module's tracker, and `context_fn` is the hook for that:
    `_forward_rng_contexts` snapshots the device default state (through engine.device) and every
    tracker stream as the forward starts; the recompute runs inside a context that restores
    them and afterwards puts back the states it found. torch's own `preserve_rng_state` stays
    on, so the CPU generator and the generators of the arguments' devices are covered by torch
    as well (on CPU that is the same state, set twice).

    Under grad-disabled execution (evaluation) this is a plain call.
    """
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_forward_rng_contexts
    )
