"""Named timers with levels, aggregated as (min, max) over ranks, in Megatron-Core's manner.

Levels say how often a timer fires and so how much it may cost: 0 = once per iteration (the
iteration itself), 1 = a few operations per iteration (forward-backward, optimizer step, grad
reduction), 2 = frequent operations (per microbatch, per p2p message). `Timers(log_level)` enables
every timer at or below its level; asking for a timer above it returns one shared no-op timer, so a
disabled timer costs a method call: no device synchronisation, no barrier, no clock read.

An enabled timer synchronises the device (through `engine.device.synchronize`, a no-op on CPU)
before reading the clock, so it measures the work queued on the GPU and not only its launch; with
`barrier=True` it also waits for every rank first, so it measures the slowest rank.

`Timers.aggregate` is a collective: every rank calls it with the same names. Each rank contributes
its elapsed seconds per name (0 for a timer it never ran), one all-gather builds a [world, n]
tensor, and each name gets (min over ranks that recorded time, max over all ranks). The spread
between the two is the load imbalance (or a straggler) that a single rank's number would hide.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from engine import device
from engine.distributed.collectives import all_gather_into

LEVELS = (0, 1, 2)


class _NoopTimer:
    """The timer handed out for levels above the Timers' log level: does nothing, records nothing."""

    name = "noop"
    log_level = -1

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass

    def elapsed(self, reset: bool = True) -> float:
        return 0.0

    def active_time(self) -> float:
        return 0.0

    def __enter__(self) -> _NoopTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


NOOP_TIMER = _NoopTimer()


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class Timer:
    """One named wall-clock timer that accumulates over start/stop pairs until read with reset."""

    def __init__(self, name: str, log_level: int = 0) -> None:
        self.name = name
        self.log_level = log_level
        self._elapsed = 0.0  # since the last reset
        self._active = 0.0  # since creation; reset() does not clear it
        self._started = False
        self._start_time = 0.0

    @property
    def running(self) -> bool:
        return self._started

    def start(self, barrier: bool = False) -> None:
        if self._started:
            raise RuntimeError(f"timer {self.name!r} is already running: stop it before starting it again")
        if barrier:
            _barrier()
        device.synchronize()
        self._start_time = time.perf_counter()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not running: start it before stopping it")
        if barrier:
            _barrier()
        device.synchronize()
        dt = time.perf_counter() - self._start_time
        self._elapsed += dt
        self._active += dt
        self._started = False

    def reset(self) -> None:
        """Clear the elapsed time (and stop the timer without recording the running interval)."""
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated since the last reset; a running timer is read without being stopped."""
        running = self._started
        if running:
            self.stop()
        value = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start()
        return value

    def active_time(self) -> float:
        """Seconds this timer has run since it was created, across resets."""
        return self._active

    def __enter__(self) -> Timer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Timers:
    """A registry of named timers; `timers(name, log_level)` creates or returns one."""

    def __init__(self, log_level: int = 1) -> None:
        if log_level not in LEVELS:
            raise ValueError(f"log_level must be one of {LEVELS}, got {log_level!r}")
        self.log_level = log_level
        self._timers: dict[str, Timer] = {}
        # Each rank's seconds per name from the last `aggregate` (what min/max summarise): a
        # straggler shows here by its rank, where min/max only show that one exists.
        self.last_per_rank: dict[str, list[float]] = {}

    def __call__(self, name: str, log_level: int = 0) -> Timer | _NoopTimer:
        if log_level not in LEVELS:
            raise ValueError(f"timer {name!r}: log_level must be one of {LEVELS}, got {log_level!r}")
        timer = self._timers.get(name)
        if timer is not None:
            if timer.log_level != log_level:
                raise ValueError(
                    f"timer {name!r} was created with log_level {timer.log_level}, "
                    f"now requested with log_level {log_level}: one name, one level"
                )
            return timer
        if log_level > self.log_level:
            return NOOP_TIMER
        timer = Timer(name, log_level)
        self._timers[name] = timer
        return timer

    def names(self) -> list[str]:
        """Names of the enabled timers created so far, in creation order."""
        return list(self._timers)

    def _local_elapsed(self, names: list[str], reset: bool) -> torch.Tensor:
        values = [self._timers[n].elapsed(reset=reset) if n in self._timers else 0.0 for n in names]
        return torch.tensor(values, dtype=torch.float64, device=device.current_device())

    def aggregate(
        self, names: list[str], reset: bool = True, normalizer: float = 1.0
    ) -> dict[str, tuple[float, float]]:
        """(min, max) seconds over ranks per name, each divided by `normalizer`.

        A collective when torch.distributed is initialised: every rank must call it with the same
        names in the same order. The min is taken over the ranks that recorded time (a rank that
        never ran the timer reports 0 and does not count); the max over all ranks. A name that no
        rank recorded (never run, or disabled by its level everywhere) is left out of the result.
        Reading the timers resets them unless `reset=False`.
        """
        if normalizer <= 0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        names = list(names)
        if not names:  # every rank passes the same names, so every rank skips the collective
            return {}
        local = self._local_elapsed(names, reset)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            world = dist.get_world_size()
            # Concatenated (flat) output, viewed as [world, n] afterwards: gloo rejects the stacked
            # [world, n] output form that NCCL accepts.
            flat = torch.empty(world * len(names), dtype=local.dtype, device=local.device)
            all_gather_into(flat, local)
            gathered = flat.view(world, len(names))
        else:
            gathered = local.unsqueeze(0)
        gathered = gathered.cpu()
        out: dict[str, tuple[float, float]] = {}
        self.last_per_rank = {}
        for i, name in enumerate(names):
            column = gathered[:, i]
            self.last_per_rank[name] = [v / normalizer for v in column.tolist()]
            recorded = column[column > 0.0]
            if recorded.numel() == 0:
                continue
            out[name] = (recorded.min().item() / normalizer, column.max().item() / normalizer)
        return out

    @staticmethod
    def format(aggregated: dict[str, tuple[float, float]]) -> str:
        """'name: min/max ms | ...' for the result of `aggregate` (already normalised)."""
        return " | ".join(
            f"{name}: {lo * 1e3:.1f}/{hi * 1e3:.1f} ms" for name, (lo, hi) in aggregated.items()
        )

    def log_string(self, names: list[str], reset: bool = True, normalizer: float = 1.0) -> str:
        """One line, min/max over ranks in ms, e.g. 'forward: 12.3/14.0 ms | backward: 20.1/22.5 ms'.

        Calls `aggregate`, so it is a collective too: every rank calls it (rank 0 usually prints it).
        """
        return self.format(self.aggregate(names, reset=reset, normalizer=normalizer))
