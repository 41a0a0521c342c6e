"""Which lines of a job's driver log a person following it should see.

The driver log (Ray Jobs') interleaves three kinds of line: ours (the engine's progress lines,
the driver's messages, a traceback when something fails), the driver's machine-readable events
(`[elastron] event {...}`, for tools: the API has them at /v1/jobs/<id>/events), and Ray's own
machinery (its Python and C++ loggers, the Train controller's resource requests, log
de-duplication notes, ANSI colour codes). `elastron logs -f` and `elastron demo` print the first
kind, an event as one short line, and write everything to a log file (`--verbose` prints it all).

Only lines known to be Ray's are hidden: anything else (a user's print, a traceback) shows.
"""

from __future__ import annotations

import json
import re

EVENT_PREFIX = "[elastron] event "

# CSI sequences (colours, cursor moves) and OSC sequences (terminal titles, links).
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")

# `(TrainController pid=123)`, `(RayTrainWorker pid=123, ip=10.0.0.1)`, `(raylet)`, `(autoscaler +3s)`.
_ACTOR_PREFIX = re.compile(r"^\((?P<who>[A-Za-z_][\w.:-]*)(?: [^)]*)?\) ?")
# Processes and actors that are Ray's own: everything they print is machinery.
_RAY_PROCESSES = {
    "raylet",
    "gcs_server",
    "autoscaler",
    "dashboard",
    "dashboard_agent",
    "runtime_env_agent",
    "monitor",
    "log_monitor",
    "TrainController",
    "TrainStateActor",
    "SynchronizationActor",
    "AutoscalingCoordinator",
}
_RAY_LINES = [
    # Python logging in Ray's format: "2026-01-01 00:00:00,000 INFO worker.py:1841 -- ..."
    re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+\S+\.py:\d+ -- "),
    # Ray's C++ (glog) lines: "[2026-01-01 00:00:00,000 E 123 456] core_worker.cc:789: ..."
    re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [DIWEF] \d+ \d+\] "),
    re.compile(r"^Running entrypoint for job "),
    re.compile(r"^\(Ray deduplicates logs by default"),
    re.compile(r"^Setting up process group for: "),
    re.compile(r"^(?:Requesting resources|Attempting to start training worker group|Started training worker group)"),
    re.compile(r"^(?:Started distributed worker processes|Moving model to device|Wrapping provided model)"),
    re.compile(r"^View detailed results here: |^To visualize your results with TensorBoard"),
    re.compile(r"/site-packages/ray/.*Warning: "),
    re.compile(r"^\*\*\* SIG[A-Z]+ received at time="),
]

_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\]")
# Ray's prefix on what a rank printed: the line itself is ours and shows without it.
_RANK_PREFIX = re.compile(r"^\((?:RayTrainWorker|RayTrainWorker\w*) [^)]*\) ?")

# Event fields that say nothing to a person reading along (the API keeps them all).
_EVENT_NOISE = {"ts", "kind", "source", "job_id", "id", "rank", "host", "node_id", "pid"}


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


def is_machinery(line: str) -> bool:
    """True for a line of Ray's own machinery (given without ANSI codes)."""
    text = line.strip()
    prefix = _ACTOR_PREFIX.match(text)
    if prefix:
        if prefix.group("who") in _RAY_PROCESSES or prefix.group("who").startswith("pid="):
            return True
        text = text[prefix.end() :]  # a rank's line: judge what it printed
    return any(p.search(text) for p in _RAY_LINES)


def event_summary(line: str) -> str | None:
    """`[elastron] event {...}` as one short line ("[elastron] restart: cause=node_lost"), None
    when it is not an event line."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        event = json.loads(line[len(EVENT_PREFIX) :])
    except ValueError:
        return "[elastron] event (unreadable)"
    if not isinstance(event, dict):
        return "[elastron] event (unreadable)"
    fields = ", ".join(
        f"{k}={_short(v)}"
        for k, v in event.items()
        if k not in _EVENT_NOISE and v not in (None, [], {}, "") and not isinstance(v, dict)
    )
    return f"[elastron] {event.get('kind', 'event')}" + (f": {fields}" if fields else "")


def _short(value: object, limit: int = 80) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def for_people(line: str) -> str | None:
    """What to print for one log line (without its newline): the line without ANSI codes, Ray's
    prefix on a rank's line or its de-duplication note, an event's short form; None for Ray's
    machinery."""
    text = _REPEATED.sub("", strip_ansi(line).rstrip("\r"))
    if is_machinery(text):
        return None
    text = _RANK_PREFIX.sub("", text)
    summary = event_summary(text)
    return summary if summary is not None else text


class LineFilter:
    """Feeds text chunks (a log stream cut anywhere), returns the whole lines to print."""

    def __init__(self) -> None:
        self._partial = ""

    def feed(self, chunk: str) -> list[str]:
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        return [out for line in lines if (out := for_people(line)) is not None]

    def flush(self) -> list[str]:
        rest, self._partial = self._partial, ""
        out = for_people(rest) if rest else None
        return [out] if out is not None else []
