"""The rank's event record: one JSON line per event, and the launcher's hook for each.

The rerun state machine writes its decisions here, and so do the checkpointer (saves, failed
saves) and the replica quorum (replicas lost and rejoined). It is its own module, below all of
them, so that each can write to the one record without importing the others: the orchestrator
reads a single stream per rank, whichever part of the engine an event comes from.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from engine import device
from engine.rank_hooks import RankIdentity


def node_identity(node_id: str) -> tuple[str, str]:
    """(node, device) this rank runs on: what a rerun 'on other hardware' must differ in."""
    return node_id, str(device.current_device())


class EventLog:
    """This rank's events: append-only JSON lines, one per event (every rank appends whole lines,
    O_APPEND), and each handed to `on_event` (a launcher's hook, in-process, from whichever
    thread made it). `node_id` is the hardware identity the launcher gave the rank
    (engine/rank_hooks.py; default: this host)."""

    def __init__(
        self,
        path: str | Path | None,
        job: str,
        node_id: str | None = None,
        on_event: Callable[[dict], None] | None = None,
    ):
        self.path, self.job = (Path(path) if path else None), job
        self.node_id = node_id or RankIdentity.local().node_id
        self.on_event = on_event
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, kind: str, **fields: Any) -> dict:
        host, dev = node_identity(self.node_id)
        rank = dist.get_rank() if dist.is_initialized() else 0
        event = {"ts": time.time(), "job": self.job, "kind": kind, "rank": rank, "host": host, "device": dev}
        event.update(fields)
        if self.path is not None:
            line = (json.dumps(event, default=str) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        if self.on_event is not None:
            self.on_event(event)
        return event
