"""How many microbatches one optimizer step takes, with Megatron-Core's step-wise batch rampup.

The global batch is the number of samples whose gradients the optimizer sees in one step; it is
the quantity that defines the training (together with the data order, the LR schedule and the
seed). The micro batch size and the data-parallel size only decide how that global batch is cut:
each of the `data_parallel_size` replicas runs `num_microbatches` forward/backward passes of
`micro_batch_size` samples and the gradients are summed across microbatches and replicas. So

    global_batch_size = num_microbatches * micro_batch_size * data_parallel_size

and when an elastic job is resized (DP 4 -> 2, say) the calculator is rebuilt with the new DP size,
the number of microbatches doubles and the optimizer keeps seeing exactly the same global batch:
the run continues the same training, only slower or faster.

Rampup (`rampup_batch_size = (start, increment, ramp_samples)`) grows the global batch step-wise
from `start` to `global_batch_size` by `increment`, in equal intervals of consumed samples:

    increments           = (global_batch_size - start) / increment
    samples_per_increment = ramp_samples / increments
    current              = min(global_batch_size,
                               start + floor(consumed_samples / samples_per_increment) * increment)

and the full global batch once `ramp_samples` samples have been consumed. The schedule is a
function of consumed samples only (not of the DP size), so a resize during rampup changes nothing
either. Every batch size of the schedule must split evenly over micro batch x DP, which holds for
all of them exactly when `start` and `increment` do (and `global_batch_size` is `start` plus a
multiple of `increment`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only; keeps this module free of the pydantic import
    from engine.jobspec import TrainingSpec


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class MicrobatchCalculator:
    """Number of microbatches per step from global batch, micro batch and data-parallel size.

    `update(consumed_samples)` advances a rampup schedule; without rampup it is a no-op. See the
    module docstring for why the global batch, not the microbatch count, is the invariant.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup_batch_size: tuple[int, int, int] | None = None,
    ) -> None:
        _positive("global_batch_size", global_batch_size)
        _positive("micro_batch_size", micro_batch_size)
        _positive("data_parallel_size", data_parallel_size)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        per_microbatch_step = micro_batch_size * data_parallel_size
        self._per_microbatch_step = per_microbatch_step
        what = (
            f"micro_batch_size ({micro_batch_size}) x data_parallel_size ({data_parallel_size}) "
            f"= {per_microbatch_step}"
        )
        if global_batch_size % per_microbatch_step:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) is not divisible by {what}: the global batch "
                f"must be a whole number of microbatches on every data-parallel rank"
            )

        self.rampup_batch_size: tuple[int, int, int] | None = None
        self._increments = 0
        if rampup_batch_size is not None:
            if len(rampup_batch_size) != 3:
                raise ValueError(
                    f"rampup_batch_size must be (start, increment, ramp_samples), got {rampup_batch_size!r}"
                )
            start, increment, ramp_samples = (int(v) for v in rampup_batch_size)
            _positive("rampup start batch size", start)
            _positive("rampup batch size increment", increment)
            _positive("rampup ramp_samples", ramp_samples)
            if start > global_batch_size:
                raise ValueError(
                    f"rampup start batch size ({start}) must not exceed global_batch_size ({global_batch_size})"
                )
            if (global_batch_size - start) % increment:
                raise ValueError(
                    f"global_batch_size ({global_batch_size}) - rampup start batch size ({start}) "
                    f"= {global_batch_size - start} is not a multiple of the rampup batch size increment "
                    f"({increment})"
                )
            if start % per_microbatch_step:
                raise ValueError(
                    f"rampup start batch size ({start}) is not divisible by {what}: every batch size "
                    f"of the rampup must be a whole number of microbatches on every data-parallel rank"
                )
            if increment % per_microbatch_step:
                raise ValueError(
                    f"rampup batch size increment ({increment}) is not divisible by {what}: every batch "
                    f"size of the rampup must be a whole number of microbatches on every data-parallel rank"
                )
            self.rampup_batch_size = (start, increment, ramp_samples)
            self._increments = (global_batch_size - start) // increment

        self._current_global_batch_size = global_batch_size
        self.update(0)

    @classmethod
    def from_spec(cls, training: TrainingSpec, data_parallel_size: int) -> MicrobatchCalculator:
        """Build from a job's `training` section and the data-parallel size of the current layout."""
        rampup = tuple(training.rampup_batch_size) if training.rampup_batch_size is not None else None
        return cls(training.global_batch_size, training.micro_batch_size, data_parallel_size, rampup)

    @property
    def current_global_batch_size(self) -> int:
        """The global batch of the current step (below `global_batch_size` during rampup)."""
        return self._current_global_batch_size

    @property
    def num_microbatches(self) -> int:
        """Microbatches each data-parallel rank runs for the current step."""
        return self._current_global_batch_size // self._per_microbatch_step

    def update(self, consumed_samples: int) -> None:
        """Recompute the current global batch after `consumed_samples` samples have been trained on."""
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        if self.rampup_batch_size is None or self._increments == 0:
            self._current_global_batch_size = self.global_batch_size
            return
        start, increment, ramp_samples = self.rampup_batch_size
        if consumed_samples >= ramp_samples:
            self._current_global_batch_size = self.global_batch_size
            return
        # floor(consumed / (ramp_samples / increments)), in exact integer arithmetic: a float
        # samples_per_increment could put a step boundary one sample early or late.
        steps = (consumed_samples * self._increments) // ramp_samples
        self._current_global_batch_size = min(self.global_batch_size, start + steps * increment)

    def __repr__(self) -> str:
        return (
            f"MicrobatchCalculator(global_batch_size={self.global_batch_size}, "
            f"micro_batch_size={self.micro_batch_size}, data_parallel_size={self.data_parallel_size}, "
            f"rampup_batch_size={self.rampup_batch_size}, current_global_batch_size="
            f"{self.current_global_batch_size}, num_microbatches={self.num_microbatches})"
        )
