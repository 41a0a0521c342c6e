"""A per-step watchdog: a rank whose training step stops making progress is failed, loudly.

A collective that never returns (a peer that hangs without dying, a wedged device) blocks the
training thread inside C code, where no Python exception can reach it. The process group's
timeout catches some of these, but only for collectives on groups that were given one, and a
hang outside a collective is not caught at all. This daemon thread watches what the training
loop is doing -- `trainer.iteration` and `trainer.phase` (engine.training.Trainer keeps both
current) -- and when the iteration has not advanced for `timeout_s` seconds it:

1. writes one line naming the rank, the step (iteration + 1, the one in progress) and the phase
   it is stuck in (e.g. "forward-backward", "grads-finalize", "checkpoint-save") to stderr;
2. dumps every thread's stack to stderr (faulthandler), so the log shows where it hangs;
3. calls `on_timeout(message)` if given (Ray workers use it to hand the message to their job's
   supervisor, so the job's failure names the cause rather than "process died");
4. kills its own process with SIGKILL (`kill=True`, the default): a launcher or Ray sees a dead
   rank and restarts the group from the last committed checkpoint.

The time a step may take includes the checkpoint save that follows it. Before the first step
(`phase == "setup"`: model build, checkpoint resume) `setup_timeout_s` applies instead.

Use:

    dog = StepWatchdog(timeout_s=300).start()
    trainer = Trainer(spec); dog.watch(trainer)
    ... train ...
    dog.stop()

`check(now)` is the whole decision and takes the clock as an argument, so it can be tested
without threads or sleeps.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

DEFAULT_STEP_TIMEOUT_S = 300.0


def _rank() -> int | None:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist.get_rank() if dist is not None and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a broken group must not stop the report
        return None


def dump_all_stacks(stream: TextIO) -> None:
    """Every thread's Python stack; faulthandler when the stream has a real file descriptor."""
    stream.flush()
    try:
        faulthandler.dump_traceback(file=stream, all_threads=True)
        return
    except (AttributeError, ValueError, OSError):  # no fileno (a captured or in-memory stream)
        pass
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        stream.write(f"\nThread {ident:#x} ({names.get(ident, '?')}), most recent call last:\n")
        stream.write("".join(traceback.format_stack(frame)))
    stream.flush()


class StepWatchdog:
    """Fails this process when the watched trainer's iteration stops advancing.

    `timeout_s`: seconds a step (plus the checkpoint save after it) may take.
    `setup_timeout_s`: seconds the setup before the first step may take (default: timeout_s).
    `on_timeout(message)`: called before the kill; exceptions in it are ignored.
    `kill`: SIGKILL this process after reporting (False: only report, e.g. in tests).
    """

    def __init__(
        self,
        timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        *,
        setup_timeout_s: float | None = None,
        on_timeout: Callable[[str], None] | None = None,
        kill: bool = True,
        poll_s: float | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.setup_timeout_s = float(setup_timeout_s if setup_timeout_s is not None else timeout_s)
        self.on_timeout = on_timeout
        self.kill = kill
        self.poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 20)
        self.stream = stream
        self.clock = clock
        self.fired: str | None = None
        self._target: Any = None
        self._last_iteration: int | None = None
        self._since = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control
    def watch(self, trainer: Any) -> None:
        """Watch `trainer` (anything with `iteration` and `phase`); the clock starts now."""
        with self._lock:
            self._target = trainer
            self._last_iteration = getattr(trainer, "iteration", None)
            self._since = self.clock()

    def start(self) -> StepWatchdog:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elastron-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> StepWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ decision
    def check(self, now: float | None = None) -> str | None:
        """The timeout message if the watched step has overrun at `now`, else None."""
        now = self.clock() if now is None else now
        with self._lock:
            target = self._target
            if target is None or self.fired is not None:
                return None
            iteration = getattr(target, "iteration", None)
            if iteration != self._last_iteration:
                self._last_iteration, self._since = iteration, now
                return None
            phase = getattr(target, "phase", "setup") or "setup"
            limit = self.setup_timeout_s if phase == "setup" else self.timeout_s
            waited = now - self._since
            if waited < limit:
                return None
        rank = _rank()
        where = f"rank {rank}" if rank is not None else f"pid {os.getpid()}"
        step = (iteration or 0) + 1
        if phase == "setup":
            what = "setup before the first step"
        elif phase == "checkpoint-save":  # the step is done; its checkpoint is being written
            what, step = f"the checkpoint save after step {iteration}", iteration
        else:
            what = f"step {step}"
        return (
            f"elastron watchdog: {where} made no progress for {waited:.0f} s in {what} "
            f"(iteration {step}, phase {phase!r}; resilience.step_timeout_s = {limit:g})"
        )

    def fail(self, message: str, report: Callable[[str], None] | None = None) -> None:
        """Fail this process now, as a timeout would (the same report, stacks and kill), for a
        stall another part saw coming: the job's Lighthouse gone
        (engine/fault_tolerance/replica_quorum.py), where the step would wait out its quorum timeout.
        `report(message)` is called in place of `on_timeout`, so the cause is not told as a
        timeout (the rank sends `lighthouse_lost`, not `watchdog_timeout`)."""
        with self._lock:
            if self.fired is not None or self._stop.is_set():  # stopped: the rank is done with it
                return
            self.fired = message
        self._fire(message, report or self.on_timeout)

    def _fire(self, message: str, report: Callable[[str], None] | None) -> None:
        self.fired = message
        stream = self.stream or sys.stderr
        try:
            stream.write(message + "\n")
            dump_all_stacks(stream)
        except Exception:  # noqa: BLE001 - reporting must not stop the kill
            pass
        if report is not None:
            try:
                report(message)
            except Exception:  # noqa: BLE001
                pass
        if self.kill:
            try:
                stream.write("elastron watchdog: killing this process (SIGKILL)\n")
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
            os.kill(os.getpid(), signal.SIGKILL)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            message = self.check()
            if message is not None:
                self._fire(message, self.on_timeout)
                return
