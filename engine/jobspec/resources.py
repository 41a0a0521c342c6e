"""`resources`: ranks (and the elastic range) and the device kind.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.jobspec.common import PositiveInt, _Section


class ResourcesSpec(_Section):
    ranks: PositiveInt = 1
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    min_ranks: PositiveInt | None = Field(
        None,
        description="Elastic jobs on Ray: the fewest ranks the job runs on (default: ranks). Only the "
        "data-parallel size changes, so sizes are multiples of tensor x pipeline x context.",
    )
    max_ranks: PositiveInt | None = Field(
        None, description="Elastic jobs on Ray: the most ranks the job grows to (default: ranks)."
    )

    @model_validator(mode="after")
    def _check_range(self) -> ResourcesSpec:
        lo = self.min_ranks if self.min_ranks is not None else self.ranks
        hi = self.max_ranks if self.max_ranks is not None else self.ranks
        if not lo <= self.ranks <= hi:
            raise ValueError(
                f"resources.min_ranks ({lo}) <= resources.ranks ({self.ranks}) <= resources.max_ranks ({hi}) "
                "does not hold: ranks is where an elastic job starts, between its min and max"
            )
        return self

    @property
    def elastic(self) -> bool:
        """Whether the rank count may change while the job runs (min_ranks < max_ranks)."""
        lo = self.min_ranks if self.min_ranks is not None else self.ranks
        hi = self.max_ranks if self.max_ranks is not None else self.ranks
        return lo < hi
