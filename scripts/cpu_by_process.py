"""Where a command's CPU time goes, by kind of process: the measuring tool of issue 52.

`make test` on 2 cores is bound by CPU-seconds, not by waiting, so making it faster starts with
knowing which processes burn them. This runs a command under the recovery bench's CpuLedger
(every process on the machine sampled from /proc: Ray's actors and daemons are not the
command's children) and prints CPU-seconds per kind of process, largest first, and the
machine's busy CPU-seconds over the run. A kind is Ray's process title as it is
(`ray::TrainController`, `ray::RayTrainWorker`), else the command line's first words.

    python scripts/cpu_by_process.py [--interval 0.3] [--top 30] [--json OUT] -- CMD ARGS...

A process that starts and ends between two samples is missed (the machine total still counts
it); a process's CPU before the run started is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.recovery_modes.cpu_ledger import CpuLedger  # noqa: E402 - needs ROOT on sys.path

SITE = "site-packages/"


def machine_cpu_s() -> float:
    """Busy CPU-seconds of the whole machine since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def process_kind(pid: int, title: str) -> str:
    """A short name for a process: Ray's `ray::Class` titles as they are, else the command's
    first words, a path outside the virtualenv's site-packages by its file name."""
    if title.startswith("ray::"):
        return title.split()[0]
    words = [w.split(SITE, 1)[-1] for w in title.split()[:3]]
    return " ".join(w.rsplit("/", 1)[-1] if w.startswith("/") else w for w in words)[:80] or "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between /proc samples")
    parser.add_argument("--top", type=int, default=30, help="kinds to print")
    parser.add_argument("--json", help="also write the CPU-seconds per kind and the totals here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to measure")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    if args.interval <= 0:
        parser.error("--interval must be above 0")

    machine_before, start = machine_cpu_s(), time.time()
    with CpuLedger(every_s=args.interval) as ledger:
        returncode = subprocess.call(command)
    end, machine = time.time(), machine_cpu_s() - machine_before
    spent = sorted(ledger.used(start, end, process_kind).items(), key=lambda kv: -kv[1])

    for kind, seconds in spent[: args.top]:
        if seconds >= 0.05:
            print(f"{seconds:9.1f} CPU-s  {kind}", file=sys.stderr)
    print(
        f"wall {end - start:.1f} s, machine busy {machine:.1f} CPU-s ({machine / (end - start):.2f} cores), "
        f"sampled processes {sum(s for _, s in spent):.1f} CPU-s",
        file=sys.stderr,
    )
    if args.json:
        with open(args.json, "w") as f:
            out = {"wall_s": end - start, "machine_cpu_s": machine, "returncode": returncode}
            json.dump({**out, "kinds": {k: round(v, 2) for k, v in spent}}, f)
    return returncode


if __name__ == "__main__":
    sys.exit(main())
