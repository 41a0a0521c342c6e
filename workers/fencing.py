"""A fenced attempt stops at once and commits no checkpoint (service/fencing.py says when the
control plane fences an attempt: it gave it up, and a newer attempt of the job runs).

Two places act on it:
- the telemetry sender's `on_fenced` (every rank and the driver): the answer to any batch says
  "fenced", and the process exits with `FENCED_EXIT` there and then: no step, no save after it;
- rank 0's checkpointer, just before it commits a checkpoint (`before_commit`): it asks the
  control plane synchronously (`TelemetrySender.still_current`), so an orphan that has not sent
  a batch since it was fenced still cannot commit into the folder the new attempt uses. An
  unreachable control plane cannot tell; the commit then goes ahead (the reconciler also stops
  the orphan's Ray job once it sees it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

FENCED_EXIT = 75  # EX_TEMPFAIL: this attempt was replaced; the job itself goes on elsewhere


def exit_fenced(message: str) -> NoReturn:
    """Leave now: no finally blocks, no checkpoint wait, no atexit (any of them could save)."""
    print(
        f"[elastron] this attempt is fenced, exiting without saving: {message}", file=sys.stderr, flush=True
    )
    sys.stderr.flush()
    os._exit(FENCED_EXIT)


def commit_guard(
    sender: Any, exit: Callable[[str], Any] = exit_fenced, timeout_s: float = 5.0
) -> Callable[[int], None]:
    """The checkpointer's `before_commit` for rank 0: exits when the control plane says this
    attempt is fenced, so the checkpoint of `iteration` is never committed."""

    def before_commit(iteration: int) -> None:
        if not sender.still_current(timeout_s):
            exit(f"the checkpoint of iteration {iteration} is not committed: a newer attempt of the job runs")

    return before_commit
