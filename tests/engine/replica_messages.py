"""What the quorum tests' replica processes report: each writes JSON lines to a file of its own
(a multiprocessing queue shared with a process that is then SIGKILLed can stay locked for every
other writer), which the test reads back whole."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def read_messages(folder: Path) -> list:
    """Every complete line of every replica's file (a SIGKILLed writer can leave half a line)."""
    return [
        json.loads(line)
        for f in sorted(folder.glob("*.jsonl"))
        for line in f.read_text().splitlines()
        if line.endswith("]")
    ]


def drain_until(folder: Path, messages: list, until: Callable[[], bool], timeout_s: float = 60.0, what: str = "") -> None:
    """Refresh `messages` in place from `folder` until `until()` holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        messages[:] = read_messages(folder)
        if until():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or 'the replicas'}; last messages: {messages[-6:]}")
        time.sleep(0.05)
