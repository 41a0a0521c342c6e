"""What a failed checkpoint save does to training: retry, skip, or stop the job.

A full disk or an object-store outage must not end a job that is otherwise healthy, and must not
make it crash-loop either (fail, restart, resume, save, fail again...). So a persistent save
whose storage operations fail is tried again `checkpoint.save_retries` times with a doubling
backoff; if it still fails it is skipped (`on_save_failure: continue`, the default: training goes
on, the next interval tries again) or it stops the job (`fail`). Skips are counted: after
`checkpoint.max_consecutive_failures` failed saves in a row the job stops anyway, with a
`CheckpointStorageError` naming the storage error, which the workers' restart policy does not
restart (the storage needs fixing, not the job), so a job never trains for days without a
checkpoint.

Only storage failures are handled here. Every rank learns of one at the same point of the save
(the checkpointer agrees on each attempt's outcome with one collective), so every rank retries
or skips together; a collective that fails (a peer died) is not a storage failure and propagates
as before.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

# Errors that mean the storage is full (a local disk, a quota): a retry rarely helps, but the next
# interval may find space freed (retention, an operator), so they are handled like any other.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointStorageError(RuntimeError):
    """The job stops because its checkpoints cannot be saved: `storage_error` is the last one."""

    def __init__(self, message: str, *, storage_error: str, failures: int) -> None:
        super().__init__(message)
        self.storage_error = storage_error
        self.failures = failures

    def __reduce__(self):
        """Picklable (Ray hands a rank's exception to the driver)."""
        return _rebuild, (str(self), self.storage_error, self.failures)


def _rebuild(message: str, storage_error: str, failures: int) -> CheckpointStorageError:
    return CheckpointStorageError(message, storage_error=storage_error, failures=failures)


def describe(err: BaseException) -> str:
    """One line naming a storage error, its cause unwrapped (DCP wraps every rank's failure in a
    CheckpointException: the first rank's own exception is the one worth naming)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return f"rank {rank}: {describe(inner)}"
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}"[:500]


def no_space(err: BaseException) -> bool:
    """Whether `err` (or what it wraps) is a full disk or an exceeded quota."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in NO_SPACE:
            return True
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                inner = value[0] if isinstance(value, tuple) else value
                if isinstance(inner, BaseException) and no_space(inner):
                    return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def out_of_space(error: str | None) -> bool:
    """Whether an agreed error line (`describe`) is a full disk or an exceeded quota. The line,
    not the exception, is what every rank shares, and it carries the OS's own words for them."""
    return error is not None and any(os.strerror(code) in error for code in NO_SPACE)


@dataclass
class SaveFailures:
    """The failure policy of one job's checkpointer (the checkpoint section's four fields) and
    its count of failed saves in a row."""

    on_failure: str = "continue"
    retries: int = 3
    backoff_s: float = 2.0
    max_consecutive: int = 3
    consecutive: int = 0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (1-based): backoff, 2x backoff, 4x, ..."""
        return self.backoff_s * (2 ** (attempt - 1))

    def succeeded(self) -> None:
        self.consecutive = 0

    def failed(self, iteration: int, error: str) -> CheckpointStorageError | None:
        """Count a save that failed after its retries; the error to stop the job with, or None
        to skip the save and train on."""
        self.consecutive += 1
        if self.on_failure == "fail":
            return CheckpointStorageError(
                f"checkpoint save of iteration {iteration} failed after {self.retries} retries: {error}; "
                "the job stops (checkpoint.on_save_failure: fail). Fix the storage, or set "
                "checkpoint.on_save_failure: continue to train on without this checkpoint",
                storage_error=error,
                failures=self.consecutive,
            )
        if self.consecutive >= self.max_consecutive:
            return CheckpointStorageError(
                f"{self.consecutive} checkpoint saves in a row failed (checkpoint.max_consecutive_failures = "
                f"{self.max_consecutive}), the last one of iteration {iteration}: {error}; the job stops rather "
                "than train on without checkpoints. Fix the storage (space, quota, credentials, endpoint) and "
                "resubmit: it resumes from its newest committed checkpoint",
                storage_error=error,
                failures=self.consecutive,
            )
        return None
