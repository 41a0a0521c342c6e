"""Run every benchmark in bench/ and keep its figures with the commit they measured.

`make bench` runs the full benches and appends their JSON lines to runs/bench/<commit>.jsonl,
each line tagged with the commit, the bench and the time, so two commits' figures can be put side
by side. `--smoke` runs each bench's `--smoke` mode (tiny sizes, seconds) instead: what
tests/test_bench_smoke.py does, so a bench that breaks fails CI rather than the next person who
needs its number. A bench fails when it exits non-zero or prints no JSON line.

    python scripts/run_benches.py [--smoke] [--only engine_step,recovery] [--out runs/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# Full runs that mean nothing without a GPU (their --smoke still runs on CPU).
NEEDS_CUDA = {"gpu_mfu"}


@dataclass
class BenchRun:
    name: str
    returncode: int
    seconds: float
    lines: list[dict] = field(default_factory=list)
    output_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.lines)

    def problem(self) -> str:
        if self.returncode != 0:
            return f"bench/{self.name}.py exited {self.returncode}:\n{self.output_tail}"
        return f"bench/{self.name}.py printed no JSON line:\n{self.output_tail}"


def benches() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def run_bench(path: Path, smoke: bool, timeout_s: float, args: tuple[str, ...] = ()) -> BenchRun:
    """Run one bench as a user would (its own process, the checkout on PYTHONPATH), with `args`
    after `--smoke` (a part of a bench, e.g. `--only recovery`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(path), *(["--smoke"] if smoke else []), *args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = f"timed out after {timeout_s:.0f} s"
    lines = []
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                lines.append(value)
    return BenchRun(path.stem, code, time.perf_counter() - start, lines, (out + err)[-3000:])


def commit_id() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="Each bench's --smoke mode (seconds each).")
    ap.add_argument("--only", default="", help="Comma-separated bench names (default: all).")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench", help="Folder for <commit>.jsonl.")
    ap.add_argument("--timeout", type=float, default=None, help="Seconds per bench (default 300 smoke, 3600 full).")
    args = ap.parse_args(argv)
    only = {n for n in args.only.split(",") if n}
    selected = [p for p in benches() if not only or p.stem in only]
    if only - {p.stem for p in selected}:
        ap.error(f"--only: no bench named {sorted(only - {p.stem for p in selected})}")
    timeout = args.timeout or (300.0 if args.smoke else 3600.0)
    commit = commit_id()
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / f"{commit}{'-smoke' if args.smoke else ''}.jsonl"
    failed = []
    for path in selected:
        if not args.smoke and path.stem in NEEDS_CUDA:
            import torch

            if not torch.cuda.is_available():
                print(f"[bench] {path.stem}: skipped (needs CUDA; scripts/gpu_check.sh runs it on a GPU)", flush=True)
                continue
        print(f"[bench] {path.stem} ...", flush=True)
        run = run_bench(path, args.smoke, timeout)
        with out_file.open("a") as f:
            for line in run.lines:
                f.write(json.dumps({"commit": commit, "bench_script": run.name, "ts": time.time(), **line}) + "\n")
        print(f"[bench] {run.name}: {'ok' if run.ok else 'FAILED'} in {run.seconds:.0f} s, {len(run.lines)} figures", flush=True)
        if not run.ok:
            failed.append(run)
            print(run.problem(), file=sys.stderr)
    print(f"[bench] figures in {out_file}" + (f"; failed: {[r.name for r in failed]}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
