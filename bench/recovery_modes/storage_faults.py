"""What a storage fault during a checkpoint save costs a job, against a clean run of the same job.

storage_fault, once per storage fault (issue 34): a 2-rank job outside Ray (the fault matrix's
supervisor, tests/faults/matrix.py) with synchronous saves every 2 steps, its iteration-4 save
hit by S3 answering 500, 503 or SlowDown, or resetting connections mid-upload, for one whole try
of the save (a fault-injecting proxy in front of a moto server started here, botocore allowed 2
retries so the checkpointer's own retry is what gets over it), or by a full disk (a small tmpfs:
root only, else the line says it was skipped). `time_lost_s`: the job's wall time (its first
record to its last) over a clean run's (target: the retry time only); `retry_s`: the faulted
save's time over the clean run's save of the same iteration; `steps_lost` (target 0) and
`restarts` (target 0); medians over `--repeats`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

from bench.recovery_modes.harness import emit


def _fault_run(spec: dict, work: Path, env: dict | None = None) -> dict:
    """One supervised run: wall seconds, restarts, steps re-run, and each save's seconds/retries."""
    from tests.faults.matrix import supervise

    run = supervise(spec, None, work, env=env)
    if not run.finished:
        raise RuntimeError(f"the job did not finish: {run.failures[-1:]}")
    saves = {}
    for line in (work / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "checkpoint_saved":
            saves[e["iteration"]] = (e["seconds"], e.get("retries", 0))
        elif e["kind"] == "checkpoint_failed":
            saves[e["iteration"]] = (None, e.get("retries", 0))
    records = sum(len(a) for a in run.attempts)
    stamps = [ts for attempt in run.attempts for _it, _loss, ts in attempt]
    return {
        "wall_s": max(stamps) - min(stamps),  # first record to last: setup (process start) left out
        "restarts": len(run.attempts) - 1,
        "steps_lost": records - len(run.merged),
        "saves": saves,
    }


def _fault_figure(fault: str, at: int, runs: list[dict], clean: list[dict]) -> None:
    med = statistics.median
    emit(
        figure="storage_fault",
        fault=fault,
        repeats=len(runs),
        time_lost_s=round(med(r["wall_s"] for r in runs) - med(c["wall_s"] for c in clean), 3),
        retry_s=round(med(r["saves"][at][0] or 0.0 for r in runs) - med(c["saves"][at][0] for c in clean), 3),
        retries=max(r["saves"][at][1] for r in runs),
        saved=all(r["saves"][at][0] is not None for r in runs),
        steps_lost=max(r["steps_lost"] for r in runs),
        restarts=max(r["restarts"] for r in runs),
    )


def storage_faults(workdir: Path, repeats: int, smoke: bool = False) -> None:
    """The storage_fault figures (module docstring)."""
    import boto3

    from bench.checkpoint_io import start_moto
    from tests.faults.matrix import base_spec
    from tests.faults.s3_proxy import FaultProxy

    at = 4
    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    env = {**creds, "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "2", "AWS_RETRY_MODE": "standard"}
    moto, endpoint = start_moto()
    try:
        bucket = "elastron-bench-faults"
        boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id="bench", aws_secret_access_key="bench",
        ).create_bucket(Bucket=bucket)

        def s3_run(name: str, fault: str | None) -> dict:
            # A clean run goes through the proxy too (fault None): the same hop, timed alike.
            with FaultProxy(endpoint, fault, match=f"iter_{at:07d}/") as proxy:
                spec = base_spec(f"s3://{bucket}/{name}", endpoint_url=proxy.url)
                return _fault_run(spec, workdir / name, {**env, "AWS_ENDPOINT_URL": proxy.url})

        if not smoke:
            s3_run("warm-up", None)  # the first run starts the launcher's process server: not counted
        clean = [s3_run(f"clean-{i}", None) for i in range(repeats)]
        # --smoke: one S3 fault (they share every code path here; tests/faults runs each kind)
        for fault in ("s3_503",) if smoke else ("s3_500", "s3_503", "s3_slowdown", "s3_reset"):
            _fault_figure(fault, at, [s3_run(f"{fault}-{i}", fault) for i in range(repeats)], clean)
    finally:
        moto.terminate()
        moto.wait(timeout=30)
    _full_disk(workdir, repeats)


def _full_disk(workdir: Path, repeats: int) -> None:
    """ENOSPC: a tmpfs with room for two checkpoints and a half (keep: 2), so the saves of 6 and
    of 8 each run out of space once, give it back, make room (one commit fewer) and commit."""
    import subprocess

    from tests.faults.matrix import base_spec

    if os.geteuid() != 0 or shutil.which("mount") is None:
        emit(figure="storage_fault", fault="enospc", skipped="needs root and mount(8) for a small tmpfs")
        return
    clean = [_fault_run(base_spec(str(workdir / f"lclean-{i}" / "ckpt")), workdir / f"lclean-{i}") for i in range(repeats)]
    events_file = workdir / "lclean-0" / "events.jsonl"
    size = max(e["bytes"] for e in map(json.loads, events_file.read_text().splitlines()) if e["kind"] == "checkpoint_saved")
    runs = []
    for i in range(repeats):
        small = workdir / f"small-{i}"
        small.mkdir(parents=True)
        room = ((size * 5 // 2) // 4096 + 8) * 4096
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(small)], capture_output=True, text=True)
        if done.returncode != 0:
            emit(figure="storage_fault", fault="enospc", skipped=f"mount failed: {done.stderr.strip()}")
            return
        try:
            runs.append(_fault_run(base_spec(str(small), save_retries=1), workdir / f"enospc-{i}"))
        finally:
            subprocess.run(["umount", str(small)], check=False)
    _fault_figure("enospc", 6, runs, clean)
