"""Where a machine's CPU went, by process: what the survive mode's `cpu_cores` figure reads."""

from __future__ import annotations

import os
import threading
import time


class CpuLedger:
    """Every process's CPU seconds on this machine, sampled from /proc every `every_s`, so a
    window's CPU can be split by who used it (the bench's ranks share 2 cores with everything a
    replacement starts). Linux only; elsewhere it records nothing."""

    def __init__(self, every_s: float = 0.5):
        self.every_s = every_s
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu-ledger", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        if os.path.isdir("/proc"):  # the window's end, however short the window was
            self.samples.append((time.time(), self._read()))

    def _read(self) -> dict[int, tuple[str, float]]:
        seen = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    # The whole command line: a Ray actor's title (`ray::TrainController`) is its
                    # first word, a Python script's name is not.
                    title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            # utime, stime: fields 14 and 15 of stat, 12 and 13 after the ")".
            seen[int(entry.name)] = (title, (int(fields[11]) + int(fields[12])) / self._tick)
        return seen

    def _run(self) -> None:
        if not os.path.isdir("/proc"):
            return
        while not self._stop.is_set():
            self.samples.append((time.time(), self._read()))
            self._stop.wait(self.every_s)

    def used(self, start: float, end: float, kind=lambda pid, title: title) -> dict[str, float]:
        """CPU seconds per kind(pid, title) between the samples nearest `start` and `end` (a
        process born inside the window counts from zero; one that died inside it, up to its last
        sample)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {}
        first, spent = inside[0][1], {}
        last_seen: dict[int, tuple[str, float]] = {}
        for _, procs in inside[1:]:
            last_seen.update(procs)
        for pid, (title, cpu) in last_seen.items():
            name = kind(pid, title)
            spent[name] = spent.get(name, 0.0) + cpu - first.get(pid, (title, 0.0))[1]
        return spent
