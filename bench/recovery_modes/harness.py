"""What every mode of bench/recovery.py shares: the jobs it trains (SMALL, MEDIUM), the local
Ray cluster it starts with a telemetry receiver in front of it, running one job there, and the
JSON line each figure is printed as."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SMALL = {
    "name": "bench-recovery",
    "model": {
        "arch": "llama",
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
    },
    "data": {"source": "text"},
    "training": {"global_batch_size": 4, "micro_batch_size": 2, "train_iters": 1000, "seed": 5},
    "optimizer": {"lr": 2e-3},
    "checkpoint": {"interval": 10},
    "resources": {"ranks": 2, "device": "cpu"},
}
# Big enough that a step is tens of milliseconds, so per-step overheads show.
MEDIUM = {
    "name": "bench-overhead",
    "model": {
        "arch": "llama",
        "num_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "seq_length": 128,
    },
    "data": {"source": "synthetic"},
    "training": {
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "train_iters": 60,
        "seed": 5,
        "log_interval": 1000,
    },
    "optimizer": {"lr": 1e-4},
    "resources": {"ranks": 2, "device": "cpu"},
}
# The fields that name the MEDIUM job in a figure's line.
MEDIUM_LABEL = {"model": "llama-4L-h256-s128-b8", "ranks": 2}
# Steps a job takes before its steady state (left out of every per-step figure).
WARMUP = 5


def emit(**fields) -> None:
    print(json.dumps({"bench": "recovery", **fields}), flush=True)


def job_spec(base: dict, train_iters: int) -> dict:
    """A copy of `base` (SMALL or MEDIUM) that trains `train_iters` steps, for a mode to add its
    own sections to."""
    spec = json.loads(json.dumps(base))
    spec["training"]["train_iters"] = train_iters
    return spec


class Receiver:
    """The control plane's telemetry endpoint, reduced to collecting what arrives and giving
    every batch the same `answer` (the TelemetryAck fields a mode sets: `stop`, `replicas`)."""

    def __init__(self):
        self.records: list[dict] = []
        self.events: list[dict] = []
        self.answer: dict = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.records.extend(batch["records"])
                outer.events.extend(batch["events"])
                body = json.dumps(outer.answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def wait_for(what, timeout_s: float = 600):
    deadline = time.monotonic() + timeout_s
    while not (value := what()):
        if time.monotonic() > deadline:
            raise TimeoutError("bench: gave up waiting")
        time.sleep(0.01)
    return value


@contextlib.contextmanager
def local_ray(num_cpus: int) -> Iterator[tuple[Receiver, Path]]:
    """A Ray cluster of our own on this machine with `num_cpus` CPUs, its jobs reporting to a
    `Receiver`; yields the receiver and a work folder, both gone after the block."""
    receiver = Receiver()
    ray_tmp = tempfile.mkdtemp(prefix="elr-bench-", dir="/tmp")  # a Ray of our own on this machine
    os.environ.update(RAY_TMPDIR=ray_tmp, ELASTRON_API_URL=receiver.url)
    # The local Ray's workers import this checkout too, not whatever elastron the venv installed.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ.pop("ELASTRON_API_TOKEN", None)
    import ray

    with tempfile.TemporaryDirectory(prefix="elastron-bench-recovery-") as tmp:
        os.environ["ELASTRON_SPOOL_DIR"] = str(Path(tmp) / "spool")
        from workers.warm_processes import job_runtime_env

        # As the driver connects for a fast-recovery job (workers/driver.py: _connect).
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=True,
            log_to_driver=False,
            runtime_env=job_runtime_env(),
        )
        try:
            yield receiver, Path(tmp)
        finally:
            ray.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)


def run_on_ray(job_id: str, spec: dict, storage: str, **options):
    from engine.jobspec import parse_job
    from workers.driver import WorkerRunOptions, run_job

    return run_job(
        job_id,
        parse_job(spec),
        WorkerRunOptions(storage_path=storage, quiet=True, flush_interval_s=0.1, **options),
    )


def train_on_ray(receiver: Receiver, job_id: str, spec: dict, storage: str) -> list[dict]:
    """One Ray job run to its end: its step records (the bench stops if the job failed)."""
    receiver.records.clear()
    result = run_on_ray(job_id, spec, storage)
    if result.exit_code != 0:
        raise SystemExit(f"bench: the Ray run failed: {result}")
    return list(receiver.records)


def steady(records: list[dict]) -> tuple[float, float]:
    """(median step_time_s, median wall seconds per iteration) after the warm-up."""
    recs = [r for r in records if r["iteration"] > WARMUP]
    walls = [
        b["ts"] - a["ts"]
        for a, b in zip(recs, recs[1:], strict=False)
        if b["iteration"] == a["iteration"] + 1
    ]
    return statistics.median(r["step_time_s"] for r in recs), statistics.median(walls)
