"""Rank functions of the fault tests: train a job under injected faults and report what a test
checks (records, losses, events, the error that stopped the job)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

from engine import parallel_state as ps


def train_with_faults(spec_dict: dict, faults, events_path: str) -> dict:
    """Train the whole job (train_rank) with `faults` installed; rank 0 returns its records'
    (iteration, loss), the seconds it took and the error that ended it (None: finished)."""
    from engine.train_loop import train_rank

    if faults is not None:
        faults.install()
    records: list[tuple[int, float]] = []
    error = None
    started = time.perf_counter()
    try:
        train_rank(
            spec_dict,
            quiet=True,
            events_out=events_path,
            on_record=lambda r: records.append((r["iteration"], r["loss"])),
        )
    except Exception as err:  # noqa: BLE001 - reported to the test
        error = f"{type(err).__name__}: {err}"
        ps.destroy_model_parallel()
    seconds = time.perf_counter() - started
    return {"records": records, "error": error, "seconds": seconds} if dist.get_rank() == 0 else {}


def events(path, kind: str | None = None) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    found = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [e for e in found if kind is None or e["kind"] == kind]
