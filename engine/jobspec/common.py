"""The pieces every section of the job specification shares: strict bounded integers, the
section base (unknown keys and non-finite floats are errors) and the divisor hint of messages.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# Strict: YAML's `true` or `yes` in an integer field is an error, not a silent 1. Bounded by
# what the store's integer columns hold (and far beyond any real size): the spec is validated
# on the API's request path, where an unbounded number could cost unbounded work.
INT_MAX = 2**31 - 1
PositiveInt = Annotated[int, Field(ge=1, le=INT_MAX, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, le=INT_MAX, strict=True)]


class _Section(BaseModel):
    # Unknown keys are an error: a misspelt `tensor_paralel` must not silently train on TP=1.
    # Floats are finite: an infinite learning rate or loss scale is no setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


def _divisors(n: int, most: int = 24) -> str:
    """The divisors of n for a 'pick one of' hint: O(sqrt n), and at most `most` of them (n comes
    from the request being validated, so this must stay cheap whatever it is)."""
    small, large, d = [], [], 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
        d += 1
    found = small + large[::-1]
    shown = ", ".join(str(x) for x in found[:most])
    return shown if len(found) <= most else f"{shown}, ... ({len(found)} in all)"
