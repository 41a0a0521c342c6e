"""Checkpoint I/O against raw transfers of the same bytes, in the same run.

A 1-rank job whose checkpoint (fp32 params + Adam's two moments) is over 1 GiB is saved and
loaded to local disk and to an S3-compatible server (moto's standalone server, started here on
loopback). References, on the very files our save produced:
- local: plain sequential file writes / reads of the same bytes;
- S3: boto3's own managed multipart upload_file / download_file (64 MiB parts, 8 threads).
Figures are throughput ratios ours / raw (target >= 0.8), and the time a training step is
blocked by an async save relative to a synchronous save (target <= 0.1). Prints JSON lines.

    python bench/checkpoint_io.py [--layers 8] [--hidden 1024] [--targets local,s3] [--smoke]

`--smoke`: a 1-layer, hidden-64 model (a ~1 MiB checkpoint), both targets, in seconds: every
code path runs and prints its lines; its figures are not measurements.

Noise: moto keeps every object over 5 MiB in a temp file, so the S3 figures move with this
machine's disk as much as with our code; run the bench a few times and take the median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from engine.launcher import spawn

GiB = 1024**3


def _job(path: str, layers: int, hidden: int, endpoint: str | None, async_save: bool) -> dict:
    return {
        "name": "bench-ckpt",
        "model": {
            "arch": "llama",
            "num_layers": layers,
            "hidden_size": hidden,
            "num_attention_heads": 16,
            "seq_length": 32,
        },
        "data": {"source": "synthetic"},
        "training": {"global_batch_size": 1, "micro_batch_size": 1, "train_iters": 10},
        "checkpoint": {"path": path, "endpoint_url": endpoint, "async_save": async_save, "keep": 10},
        "resources": {"ranks": 1, "device": "cpu"},
    }


def _measure(job: dict) -> dict:
    """Two saves (timed: blocked and total), then a resume into a fresh trainer (timed)."""
    from engine import parallel_state as ps
    from engine.jobspec import JobSpec
    from engine.training import Trainer

    spec = JobSpec.model_validate(job)
    trainer = Trainer(spec)
    out = {}
    for n in (1, 2):
        trainer.train_step()
        start = time.perf_counter()
        trainer.checkpointer.save()
        out[f"blocked_{n}_s"] = time.perf_counter() - start
        trainer.checkpointer.wait()
        out[f"save_{n}_s"] = time.perf_counter() - start
    ps.destroy_model_parallel()

    fresh_spec = spec.model_copy(deep=True)
    fresh_spec.checkpoint.resume = "never"
    fresh = Trainer(fresh_spec)  # built and initialised without timing: the load is what we time
    fresh.spec = spec
    start = time.perf_counter()
    assert fresh.make_checkpointer().maybe_resume() == 2
    out["load_s"] = time.perf_counter() - start
    ps.destroy_model_parallel()
    return out


def _raw_local(files: list[Path], scratch: Path) -> tuple[float, float]:
    data = [f.read_bytes() for f in files]
    start = time.perf_counter()
    for i, blob in enumerate(data):
        with open(scratch / f"raw_{i}", "wb") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
    write_s = time.perf_counter() - start
    os.system("sync")
    start = time.perf_counter()
    for i in range(len(data)):
        (scratch / f"raw_{i}").read_bytes()
    return write_s, time.perf_counter() - start


def _raw_s3(files: list[Path], endpoint: str, bucket: str, scratch: Path) -> tuple[float, float]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=endpoint)
    config = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20, max_concurrency=8)
    start = time.perf_counter()
    for i, f in enumerate(files):
        client.upload_file(str(f), bucket, f"raw/{i}", Config=config)
    up = time.perf_counter() - start
    start = time.perf_counter()
    for i, _ in enumerate(files):
        client.download_file(bucket, f"raw/{i}", str(scratch / f"down_{i}"), Config=config)
    return up, time.perf_counter() - start


def start_moto() -> tuple[subprocess.Popen, str]:
    """A moto S3 server on a free port (also bench/recovery.py's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    binary = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(binary), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url, timeout=1)
            return proc, url
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def _line(**fields) -> None:
    print(json.dumps({"bench": "checkpoint_io", **fields}), flush=True)


def _vs_raw(target: str, figure: str, ours_s: float, raw_s: float) -> None:
    """Throughput ratio ours / raw on the same bytes = raw time / our time (target >= 0.8)."""
    _line(
        target=target,
        figure=figure,
        value=round(raw_s / ours_s, 3),
        ours_s=round(ours_s, 2),
        raw_s=round(raw_s, 2),
        target_ratio=0.8,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="model layers (default 8: a 1.14 GiB checkpoint)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size")
    ap.add_argument("--targets", default="local,s3", help="comma-separated subset of local,s3")
    ap.add_argument("--smoke", action="store_true", help="tiny model, both targets: a quick check that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.targets = 1, 64, "local,s3"
    if not set(args.targets.split(",")) <= {"local", "s3"}:
        ap.error(f"--targets: {args.targets!r} is not a subset of local,s3")
    from engine.jobspec import JobSpec

    JobSpec.model_validate(_job("unused", args.layers, args.hidden, None, False))  # before moto starts
    targets = set(args.targets.split(","))
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    scratch = Path(tempfile.mkdtemp(prefix="elastron-bench-ckpt-"))
    moto, endpoint = start_moto()
    try:
        # Local disk: synchronous, then asynchronous save. The synchronous save also makes the
        # shard files the raw S3 reference sends, so it runs even for --targets s3.
        local_root = scratch / "local"
        sync = spawn(
            _measure, 1, (_job(str(local_root), args.layers, args.hidden, None, False),), timeout_s=1800
        )[0]
        files = sorted((local_root / "bench-ckpt" / "iter_0000002").glob("*.distcp"))
        size = sum(f.stat().st_size for f in files)
        _line(target="local", figure="checkpoint_bytes", value=size, gib=round(size / GiB, 2))
        if "local" in targets:
            raw_write, raw_read = _raw_local(files, scratch)
            _vs_raw("local", "save_ratio_ours_over_raw", sync["save_2_s"], raw_write)
            _vs_raw("local", "load_ratio_ours_over_raw", sync["load_s"], raw_read)
        kept = scratch / "shards"  # the same bytes, for the raw S3 reference below
        kept.mkdir()
        files = [Path(shutil.move(str(f), kept / f.name)) for f in files]
        shutil.rmtree(local_root)
        if "local" in targets:
            async_local = spawn(
                _measure, 1, (_job(str(local_root), args.layers, args.hidden, None, True),), timeout_s=1800
            )[0]
            _line(
                target="local",
                figure="async_blocked_over_sync_save",
                value=round(async_local["blocked_2_s"] / sync["save_2_s"], 3),
                blocked_s=round(async_local["blocked_2_s"], 3),
                first_save_blocked_s=round(async_local["blocked_1_s"], 3),
                sync_save_s=round(sync["save_2_s"], 2),
                target_ratio=0.1,
            )
        if "s3" not in targets:
            return

        # S3 (moto on loopback).
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        s3 = spawn(
            _measure,
            1,
            (_job("s3://bench/ckpt", args.layers, args.hidden, endpoint, False),),
            timeout_s=1800,
            env={
                k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
            },
        )[0]
        raw_up, raw_down = _raw_s3(files, endpoint, "bench", scratch)
        _vs_raw("s3", "save_ratio_ours_over_raw_boto3", s3["save_2_s"], raw_up)
        _vs_raw("s3", "load_ratio_ours_over_raw_boto3", s3["load_s"], raw_down)
    finally:
        moto.terminate()
        moto.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(Path(tempfile.gettempdir()) / "elastron-ckpt-cache" / "bench-ckpt", ignore_errors=True)


if __name__ == "__main__":
    main()
