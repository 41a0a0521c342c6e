"""Where a command's CPU time goes, by kind of process: the measuring tool of issue 52.

`make test` on 2 cores is bound by CPU-seconds, not by waiting, so making it faster starts with
knowing which processes burn them. This runs a command and samples /proc every `--interval`
seconds (every process on the machine: Ray's actors and daemons are not the command's
children), then prints CPU-seconds per kind of process, largest first, and the machine's total
over the run. A kind is the process's name as `ps` shows it after Ray renames its workers
(`ray::TrainController`, `ray::RayTrainWorker`), else its command line's first words; a process
that changes name (an idle Ray worker that becomes an actor) counts under its last name.

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
import threading
import time
from collections import Counter
from dataclasses import dataclass

TICK = os.sysconf("SC_CLK_TCK")
SITE = "site-packages/"


@dataclass
class Seen:
    name: str
    cpu_at_first_sample: float
    cpu: float


def machine_cpu_s() -> float:
    """Busy CPU-seconds of the whole machine since boot (user, nice, system, irq, softirq)."""
    fields = open("/proc/stat").readline().split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / TICK


def process_kind(cmdline: str) -> str:
    """A short name for a process: Ray's `ray::Class` names as they are, else the command's
    first words, a path outside the virtualenv's site-packages by its file name."""
    if cmdline.startswith("ray::"):
        return cmdline.split()[0]
    words = [w.split(SITE, 1)[-1] for w in cmdline.split()[:3]]
    return " ".join(w.rsplit("/", 1)[-1] if w.startswith("/") else w for w in words)[:80]


def sample(seen: dict[tuple[str, str], Seen], first: bool, me: int) -> None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended between listdir and open
            continue
        after_name = stat.rsplit(")", 1)[1].split()
        cpu = (int(after_name[11]) + int(after_name[12])) / TICK  # utime + stime
        key = (pid, after_name[19])  # pid + start time: a reused pid is another process
        if key not in seen:
            seen[key] = Seen(cmdline.strip() or "?", cpu if first else 0.0, cpu)
        else:
            seen[key].cpu = cpu
            if cmdline.strip():
                seen[key].name = cmdline.strip()


def by_kind(seen: dict[tuple[str, str], Seen]) -> tuple[Counter, Counter]:
    cpu, count = Counter(), Counter()
    for s in seen.values():
        kind = process_kind(s.name)
        cpu[kind] += s.cpu - s.cpu_at_first_sample
        count[kind] += 1
    return cpu, count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between /proc samples")
    parser.add_argument("--top", type=int, default=30, help="kinds to print")
    parser.add_argument("--json", help="also write {kind: [cpu_s, processes]} and the totals here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to measure")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    if args.interval <= 0:
        parser.error("--interval must be above 0")

    seen: dict[tuple[str, str], Seen] = {}
    done = threading.Event()
    me = os.getpid()

    def sampler() -> None:
        first = True
        while not done.is_set():
            sample(seen, first, me)
            first = False
            done.wait(args.interval)

    machine_before, wall_before = machine_cpu_s(), time.monotonic()
    sample(seen, True, me)  # what runs before the command is counted from here on
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    returncode = subprocess.call(command)
    done.set()
    thread.join()
    sample(seen, False, me)
    wall, machine = time.monotonic() - wall_before, machine_cpu_s() - machine_before

    cpu, count = by_kind(seen)
    for kind, seconds in cpu.most_common(args.top):
        if seconds >= 0.05:
            print(f"{seconds:9.1f} CPU-s {count[kind]:5d} processes  {kind}", file=sys.stderr)
    print(
        f"wall {wall:.1f} s, machine busy {machine:.1f} CPU-s ({machine / wall:.2f} cores), "
        f"sampled processes {sum(cpu.values()):.1f} CPU-s",
        file=sys.stderr,
    )
    if args.json:
        kinds = {k: [round(v, 2), count[k]] for k, v in cpu.most_common()}
        with open(args.json, "w") as f:
            json.dump({"wall_s": wall, "machine_cpu_s": machine, "returncode": returncode, "kinds": kinds}, f)
    return returncode


if __name__ == "__main__":
    sys.exit(main())
