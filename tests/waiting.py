"""Polling with a deadline, for tests that wait on real processes (servers, Ray, Prometheus).

A generous deadline that fails the test with what it waited for, never a timing assertion.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    predicate: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition", interval_s: float = 0.05
) -> Any:
    """Poll until `predicate()` is truthy and return its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)
