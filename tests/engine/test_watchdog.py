"""The per-step watchdog: the decision on a fake clock, and the real thing in a subprocess that
hangs (message naming step and phase, every thread's stack, then SIGKILL)."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.watchdog import StepWatchdog

ROOT = Path(__file__).resolve().parents[2]


def test_a_step_that_overruns_is_reported_with_its_step_and_phase():
    trainer = SimpleNamespace(iteration=0, phase="setup")
    dog = StepWatchdog(timeout_s=10, setup_timeout_s=100, kill=False, clock=lambda: 0.0)
    dog.watch(trainer)
    assert dog.check(now=50) is None  # setup has its own, longer budget
    trainer.iteration, trainer.phase = 1, "forward-backward"
    assert dog.check(now=60) is None  # progress restarts the clock
    trainer.iteration, trainer.phase = 2, "optimizer"
    assert dog.check(now=65) is None
    trainer.phase = "grads-finalize"  # a phase change alone is not progress
    assert dog.check(now=74) is None
    message = dog.check(now=76)
    assert message is not None
    assert "step 3" in message and "'grads-finalize'" in message and "11 s" in message


def test_setup_that_overruns_is_reported_as_setup():
    dog = StepWatchdog(timeout_s=10, setup_timeout_s=30, kill=False, clock=lambda: 0.0)
    dog.watch(SimpleNamespace(iteration=0, phase="setup"))
    assert dog.check(now=29) is None
    assert "setup before the first step" in dog.check(now=31)



def test_a_stuck_checkpoint_save_names_the_step_it_saves():
    """Saving happens after step N with trainer.iteration == N: the message names step N's save,
    not step N + 1 (which has not started)."""
    trainer = SimpleNamespace(iteration=10, phase="checkpoint-save")
    dog = StepWatchdog(timeout_s=10, kill=False, clock=lambda: 0.0)
    dog.watch(trainer)
    message = dog.check(now=11)
    assert "the checkpoint save after step 10" in message and "(iteration 10," in message

def test_nothing_is_watched_until_watch_is_called():
    dog = StepWatchdog(timeout_s=1, kill=False, clock=lambda: 0.0)
    assert dog.check(now=1e9) is None


def test_firing_reports_stacks_and_calls_back_without_killing_when_asked():
    trainer = SimpleNamespace(iteration=4, phase="optimizer")
    seen: list[str] = []
    out = io.StringIO()
    dog = StepWatchdog(timeout_s=0.05, kill=False, on_timeout=seen.append, stream=out, poll_s=0.01)
    dog.watch(trainer)
    with dog:
        dog._thread.join(timeout=30)  # it fires once and ends
    assert dog.fired is not None and seen == [dog.fired]
    assert "step 5" in dog.fired and "'optimizer'" in dog.fired
    text = out.getvalue()
    assert text.startswith(dog.fired) and "elastron-watchdog" in text  # all threads' stacks


def test_fail_reports_at_once_once_and_not_after_stop():
    """`fail` (the job's Lighthouse gone): the timeout's report and callback now, only once, and
    nothing once the rank has stopped its watchdog."""
    seen: list[str] = []
    dog = StepWatchdog(timeout_s=600, kill=False, on_timeout=seen.append, stream=io.StringIO())
    dog.watch(SimpleNamespace(iteration=4, phase="optimizer"))
    with dog:
        dog.fail("the Lighthouse is gone")
        dog.fail("again")
    assert seen == ["the Lighthouse is gone"] and dog.fired == seen[0]
    told: list[str] = []  # a report of its own in place of the timeout's callback
    own = StepWatchdog(timeout_s=600, kill=False, on_timeout=seen.append, stream=io.StringIO())
    with own:
        own.fail("lost", report=told.append)
    assert told == ["lost"] and len(seen) == 1
    stopped = StepWatchdog(timeout_s=600, kill=False, on_timeout=seen.append, stream=io.StringIO())
    with stopped:
        pass
    stopped.fail("after the rank ended")
    assert stopped.fired is None and len(seen) == 1


def test_invalid_timeout_is_refused():
    with pytest.raises(ValueError, match="positive"):
        StepWatchdog(timeout_s=0)


HANGING_RANK = textwrap.dedent(
    """
    import threading, time
    from types import SimpleNamespace
    from engine.watchdog import StepWatchdog

    trainer = SimpleNamespace(iteration=6, phase="forward-backward")
    dog = StepWatchdog(timeout_s=0.3, poll_s=0.02).start()
    dog.watch(trainer)
    threading.Event().wait()  # a collective that never returns
    """
)


def test_a_hung_process_dumps_its_stacks_and_is_killed():
    proc = subprocess.run(
        [sys.executable, "-c", HANGING_RANK], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "made no progress" in proc.stderr and "step 7" in proc.stderr
    assert "'forward-backward'" in proc.stderr
    assert "most recent call first" in proc.stderr  # faulthandler's dump of every thread
    assert "killing this process" in proc.stderr
