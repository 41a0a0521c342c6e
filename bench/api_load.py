"""Control-plane latency under a fixed request rate, and the cost of a /metrics scrape.

Starts the API (uvicorn, its own process, SQLite in a temporary folder) over a store holding
`--jobs` jobs (`--running` of them running with a metrics record each, the rest finished long
ago), with a launcher that accepts every submission at once (no Ray: this measures the API and
its store, and the reconciler polling the running jobs meanwhile). Then, open loop on loopback:
every 1/rate seconds the next request of the cycle submit, list, get, healthz is sent, whether
or not earlier ones have answered (latency is measured from the scheduled send time, so a
stalled server cannot hide behind a waiting client), for `--duration` seconds. Then
`--scrapes` sequential /metrics scrapes.

One JSON line per figure: p50/p99 in ms per operation as the client saw them, each p50 as a
ratio to /healthz in the same run (the floor: HTTP on loopback plus the app's middleware), and
the server's own p50/p99 from its request histogram (what the API spent, without the client's
or the machine's scheduling delays).

    .venv/bin/python bench/api_load.py [--duration 60] [--rate 40] [--jobs 1000] [--running 100] [--smoke]

`--smoke`: 2 s at 20/s over 20 jobs (5 running), 3 scrapes: every step runs and prints its
lines in seconds; its figures are not measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPS = ("submit", "list", "get", "healthz")
SPEC = {"name": "bench", "training": {"train_iters": 1000, "global_batch_size": 8}}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the server side ---------------------------------------------------------------------------


def serve(home: Path, port: int) -> None:
    """Run the API with a launcher that runs nothing (every submission is "running" at once)."""
    import uvicorn

    from service.app import create_app
    from service.launcher import Launcher, LaunchStatus
    from service.settings import Settings

    class AcceptAll(Launcher):
        def submit(self, job_id, spec_json, env, *, submission_id=None):
            return submission_id

        def status(self, submission_id):
            return LaunchStatus.RUNNING

        def stop(self, submission_id):
            return True

        def logs(self, submission_id):
            return ""

        async def tail(self, submission_id):
            return
            yield

        def reachable(self):
            return True

    settings = Settings(
        home=home,
        api_url=f"http://127.0.0.1:{port}",
        submit_rate_per_minute=1e9,
        submit_burst=10**9,
        metrics_require_token=False,  # the scrapes measure the exposition, on loopback
    )
    uvicorn.run(create_app(settings, launcher=AcceptAll()), host="127.0.0.1", port=port, log_level="warning")


def seed_store(home: Path, jobs: int, running: int) -> tuple[str, list[str]]:
    """`jobs` jobs of tenant bench: `running` running with one record, the rest finished a day ago."""
    from engine.jobspec import parse_job
    from service.store import stats as job_stats
    from service.store.db import make_engine, make_sessionmaker
    from service.store.jobs import create_job, new_job_id
    from service.store.migrate import upgrade
    from service.store.tokens import create_token

    engine = make_engine(f"sqlite:///{home / 'elastron.db'}")
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    _, token = create_token(sessions, "bench")
    spec = parse_job(SPEC).model_dump(mode="json")
    ids = []
    with sessions() as s, s.begin():
        for i in range(jobs):
            job = create_job(
                s,
                job_id=new_job_id("bench"),
                tenant="bench",
                spec=spec,
                idempotency_key=None,
                request_hash=None,
            )
            ids.append(job.id)
            if i < running:
                record = {
                    "iteration": 5,
                    "loss": 3.0,
                    "lr": 1e-4,
                    "grad_norm": 1.0,
                    "tokens": 8192,
                    "step_time_s": 0.5,
                    "tokens_per_s": 16384.0,
                    "mfu": 0.4,
                    "attempt": 0,
                    "timers": {"forward": [0.1, 0.11], "backward": [0.2, 0.21]},
                }
                stats = {"transitions": {"queued": 1, "starting": 1, "running": 1}, "tokens": 40960}
                job_stats.observe(stats, "step", job_stats.STEP_BUCKETS, 0.5)
                job.state, job.submission_id, job.attempt = "running", f"elastron-{job.id}-1", 1
                job.current_iteration, job.last_record, job.last_progress_at, job.stats = (
                    5,
                    record,
                    time.time(),
                    stats,
                )
            else:
                job.state, job.finished_at = "succeeded", time.time() - 2 * 86400
    engine.dispose()
    return token, ids


# -- the client side ---------------------------------------------------------------------------


async def load(url: str, token: str, ids: list[str], rate: float, duration: float) -> dict[str, dict]:
    import httpx

    latencies: dict[str, list[float]] = {op: [] for op in OPS}
    errors = dict.fromkeys(OPS, 0)
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30, limits=limits
    ) as client:

        async def one(op: str, scheduled: float) -> None:
            try:
                if op == "submit":
                    r = await client.post("/v1/jobs", json=SPEC)
                elif op == "list":
                    r = await client.get("/v1/jobs", params={"limit": 50})
                elif op == "get":
                    r = await client.get(f"/v1/jobs/{rng.choice(ids)}")
                else:
                    r = await client.get("/healthz")
                ok = r.status_code < 400
            except httpx.HTTPError:
                ok = False
            latencies[op].append(time.perf_counter() - scheduled)
            if not ok:
                errors[op] += 1

        tasks, start, n = [], time.perf_counter(), int(rate * duration)
        for i in range(n):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(OPS[i % len(OPS)], scheduled)))
        await asyncio.gather(*tasks)
    return {op: {"latencies": latencies[op], "errors": errors[op]} for op in OPS}


def scrape(url: str, count: int) -> tuple[list[float], int, str]:
    import httpx

    times, size, text = [], 0, ""
    with httpx.Client(base_url=url) as client:
        client.get("/metrics")  # warm
        for _ in range(count):
            t = time.perf_counter()
            r = client.get("/metrics")
            times.append(time.perf_counter() - t)
            size, text = len(r.content), r.text
    return times, size, text


_ROUTES = {
    "submit": ("POST", "/v1/jobs"),
    "list": ("GET", "/v1/jobs"),
    "get": ("GET", "/v1/jobs/{job_id}"),
    "healthz": ("GET", "/healthz"),
}


def server_quantiles(url: str) -> dict[str, tuple[float, float]]:
    """p50/p99 per operation as the API measured them (its request histogram, interpolated within
    buckets): the server's share of the latency, without the client's or the scheduler's."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name != "elastron_http_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                key = (sample.labels["method"], sample.labels["route"])
                buckets.setdefault(key, []).append((float(sample.labels["le"]), sample.value))

    def quantile(points: list[tuple[float, float]], q: float) -> float:
        points = sorted(points)
        target, prev_le, prev_n = q * points[-1][1], 0.0, 0.0
        for le, n in points:
            if n >= target:
                if le == float("inf"):
                    return prev_le
                return prev_le + (le - prev_le) * ((target - prev_n) / (n - prev_n) if n > prev_n else 1.0)
            prev_le, prev_n = le, n
        return prev_le

    return {
        op: (quantile(buckets[k], 0.5), quantile(buckets[k], 0.99))
        for op, k in _ROUTES.items()
        if k in buckets
    }


def report_scrape(url: str, count: int, phase: str, floor: float | None = None) -> None:
    times, size, text = scrape(url, count)
    p50, p99 = _pct(times, 0.5), _pct(times, 0.99)
    line = {
        "bench": "metrics_scrape",
        "phase": phase,
        "jobs_on_metrics": text.count("elastron_job_train_iterations{"),
        "scrapes": len(times),
        "bytes": size,
        "p50_ms": round(p50 * 1e3, 2),
        "p99_ms": round(p99 * 1e3, 2),
    }
    if floor:
        line["p50_vs_healthz"] = round(p50 / floor, 2)
    print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument(
        "--rate", type=float, default=40.0, help="requests per second, all operations (default 40)"
    )
    parser.add_argument(
        "--jobs", type=int, default=1000, help="jobs in the store before the load (default 1000)"
    )
    parser.add_argument(
        "--running", type=int, default=100, help="of which running, on /metrics (default 100)"
    )
    parser.add_argument("--scrapes", type=int, default=50, help="sequential /metrics scrapes (default 50)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a quick check that it runs")
    parser.add_argument("--serve", nargs=2, metavar=("HOME", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve[0]), int(args.serve[1]))
        return
    if args.smoke:
        args.duration, args.rate, args.jobs, args.running, args.scrapes = 2.0, 20.0, 20, 5, 3
    if int(args.rate * args.duration) < len(OPS) or not 0 <= args.running <= args.jobs or args.scrapes < 1:
        parser.error("need rate * duration >= 4 (one request per operation), 0 <= running <= jobs, scrapes >= 1")

    import httpx

    home = Path(tempfile.mkdtemp(prefix="elastron-bench-"))
    token, ids = seed_store(home, args.jobs, args.running)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(home), str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the API did not start")
            time.sleep(0.1)
        report_scrape(url, args.scrapes, "before_load")  # the store's `--running` jobs on /metrics
        results = asyncio.run(load(url, token, ids, args.rate, args.duration))
        server_side = server_quantiles(url)
        floor = statistics.median(results["healthz"]["latencies"])
        for op in OPS:
            lat = results[op]["latencies"]
            p50, p99 = _pct(lat, 0.5), _pct(lat, 0.99)
            print(
                json.dumps(
                    {
                        "bench": "api_load",
                        "op": op,
                        "store_jobs": args.jobs,
                        "rate_per_s": args.rate,
                        "duration_s": args.duration,
                        "requests": len(lat),
                        "errors": results[op]["errors"],
                        "p50_ms": round(p50 * 1e3, 2),
                        "p99_ms": round(p99 * 1e3, 2),
                        "p50_vs_healthz": round(p50 / floor, 2),
                        "server_p50_ms": round(server_side[op][0] * 1e3, 2),
                        "server_p99_ms": round(server_side[op][1] * 1e3, 2),
                    }
                ),
                flush=True,
            )
        report_scrape(url, args.scrapes, "after_load", floor)  # plus every job submitted meanwhile
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
