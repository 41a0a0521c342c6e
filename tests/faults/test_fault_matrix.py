"""The fault matrix (issue 34): where a fault can land, and proof that the job survives each.

One table, `ROWS`: SIGKILL and SIGSTOP of one rank during forward, during the gradient
reduction, during an async save's upload, during the commit (the manifest write) and during an
in-memory snapshot's seal; S3 answering 500, 503 and SlowDown, and resetting connections mid-upload
(a fault-injecting proxy in front of the moto server); ENOSPC on a small file system; the API
process killed between recording a job and launching it (tests/faults/test_api_crash.py, which
the table names). For every row the harness (matrix.py) checks: the job finishes; every
iteration has exactly one record (a later attempt's replacing an earlier one, as the API
applies them) and each loss is bitwise the clean run's (CPU); no torn or partial checkpoint
remains; and it prints the time to recover.

`make test` runs one row of each fault column (`slow=False`); the rest are marked `faults_slow`,
deselected by default (pyproject.toml). Run them all with:

    pytest -m faults_slow tests/faults          # or: pytest -m "faults_slow or not faults_slow" tests/faults
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from engine.checkpointing.backends import open_storage
from tests.faults.matrix import Row, base_spec, check_run, check_storage, supervise
from tests.faults.run import events

PROCESS_POINTS = ("forward", "grad_reduce", "async_upload", "commit", "snapshot_seal")
CHEAP = {("sigkill", "forward"), ("sigstop", "commit"), ("s3_503", "upload"), ("enospc", "save")}

ROWS = (
    [Row(f, w, at={"async_upload": 4, "commit": 4, "snapshot_seal": 7}.get(w, 5), slow=(f, w) not in CHEAP)
     for f in ("sigkill", "sigstop") for w in PROCESS_POINTS]
    + [Row(f, "upload", at=4, slow=(f, "upload") not in CHEAP) for f in ("s3_500", "s3_503", "s3_slowdown", "s3_reset")]
    + [Row("enospc", "save", at=4, slow=False)]
)
# The API row runs in the service's harness (test_api_crash.py); listed here so the table is whole.
API_ROW = Row("api_kill", "before_launch", at=0, slow=False)


def _param(row: Row):
    return pytest.param(row, id=row.name, marks=[pytest.mark.faults_slow] if row.slow else [])


def test_the_table_has_every_row_of_the_issue_and_one_cheap_case_per_column():
    names = {r.name for r in [*ROWS, API_ROW]}
    expected = {f"{f}-{w}" for f in ("sigkill", "sigstop") for w in PROCESS_POINTS}
    expected |= {f"{f}-upload" for f in ("s3_500", "s3_503", "s3_slowdown", "s3_reset")}
    expected |= {"enospc-save", "api_kill-before_launch"}
    assert names == expected
    columns = {r.fault.split("_")[0] for r in [*ROWS, API_ROW]}  # sigkill, sigstop, s3, enospc, api
    assert columns == {r.fault.split("_")[0] for r in [*ROWS, API_ROW] if not r.slow}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The clean run's records (no fault), one per checkpoint flavour the rows use."""
    cache: dict = {}

    def get(**flavour) -> dict[int, float]:
        key = tuple(sorted(flavour.items()))
        if key not in cache:
            work = tmp_path_factory.mktemp("clean")
            run = supervise(base_spec(str(work / "ckpt"), **flavour), None, work)
            assert run.finished and len(run.attempts) == 1
            cache[key] = run.merged
        return cache[key]

    return get


def _flavour(row: Row) -> dict:
    if row.where == "async_upload":
        return {"async_save": True}
    if row.where == "snapshot_seal":  # persistent at 4 and 8: the seal of 7 fails, 6 is in memory
        return {"local_interval": 1, "interval": 4}
    return {}


def _report(row: Row, run) -> None:
    print(
        f"\n[fault matrix] {row.name}: {len(run.attempts)} attempt(s), "
        + ("no restart, " if run.recover_s is None else f"time to recover {run.recover_s:.2f} s, ")
        + f"whole run {run.seconds:.1f} s"
    )


@pytest.mark.parametrize("row", [_param(r) for r in ROWS if r.fault in ("sigkill", "sigstop")])
def test_a_rank_killed_or_frozen(row: Row, tmp_path, clean):
    flavour = _flavour(row)
    spec = base_spec(str(tmp_path / "ckpt"), **flavour)
    run = supervise(spec, row, tmp_path / "work")
    _report(row, run)
    assert run.fault_at is not None, f"{row.name}: the fault never struck"
    assert len(run.attempts) >= 2
    if row.where == "snapshot_seal":  # the restart resumed from the snapshots the ranks still had
        got = json.loads((tmp_path / "work" / f"recovered-{len(run.attempts) - 1}.json").read_text())
        assert got["recovered_from"] == "memory" and got["iteration"] == row.at - 1, got
        print(f"[fault matrix] {row.name}: recovered from memory at iteration {got['iteration']}")
    check_run(run, clean(**flavour), row.name)
    check_storage(open_storage(str(tmp_path / "ckpt")), "job", 8)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS if r.fault.startswith("s3_")])
def test_s3_faults(row: Row, tmp_path, clean, s3_server, s3_bucket):
    from tests.faults.s3_proxy import FaultProxy

    env = {
        k: os.environ[k]
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE",
                  "AWS_SHARED_CREDENTIALS_FILE", "AWS_EC2_METADATA_DISABLED")
    }
    # botocore gives up after 2 tries, so the checkpointer's own retry is what gets over the fault.
    env.update(AWS_MAX_ATTEMPTS="2", AWS_RETRY_MODE="standard")
    with FaultProxy(s3_server, row.fault, match=f"iter_{row.at:07d}/") as proxy:
        spec = base_spec(f"s3://{s3_bucket}/ckpt", endpoint_url=proxy.url)
        run = supervise(spec, None, tmp_path / "work", env={**env, "AWS_ENDPOINT_URL": proxy.url})
    _report(row, run)
    assert proxy.struck and proxy.healed, f"{row.name}: the proxy struck {proxy.struck} uploads"
    assert len(run.attempts) == 1  # never a restart: the save retried in place
    check_run(run, clean(), row.name)
    saved = {e["iteration"]: e for e in events(tmp_path / "work" / "events.jsonl", "checkpoint_saved")}
    assert saved[row.at]["retries"] >= 1 and not events(tmp_path / "work" / "events.jsonl", "checkpoint_failed")
    print(f"[fault matrix] {row.name}: save of iteration {row.at} took {saved[row.at]['seconds']:.2f} s "
          f"with {saved[row.at]['retries']} retry(ies); steps lost 0")
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server)
    assert not client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads"), "unfinished multipart uploads"
    check_storage(open_storage(f"s3://{s3_bucket}/ckpt", endpoint_url=s3_server), "job", 8)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS if r.fault == "enospc"])
def test_a_full_disk(row: Row, tmp_path, clean):
    """A tmpfs with room for two checkpoints and a half (keep: 2): the third save runs out of
    space half way, its files go, the retry first drops the oldest commit (one fewer than keep)
    and commits; so does the fourth. Zero steps lost, no restart."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to mount a small tmpfs")
    ref = clean()
    small = tmp_path / "small"
    small.mkdir()
    probe = tmp_path / "probe"
    probe_run = supervise(base_spec(str(probe / "ckpt")), None, probe)
    size = max(e["bytes"] for e in events(probe / "events.jsonl", "checkpoint_saved"))
    assert probe_run.finished
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={((size * 5 // 2) // 4096 + 8) * 4096}", "tmpfs",
                           str(small)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed: {done.stderr.strip()}")
    try:
        run = supervise(base_spec(str(small), save_retries=1), None, tmp_path / "work")
        _report(row, run)
        saved = {e["iteration"]: e["retries"] for e in events(tmp_path / "work" / "events.jsonl", "checkpoint_saved")}
        assert saved == {2: 0, 4: 0, 6: 1, 8: 1} and not events(tmp_path / "work" / "events.jsonl", "checkpoint_failed")
        assert len(run.attempts) == 1
        check_run(run, ref, row.name)
        check_storage(open_storage(str(small)), "job", 8)
        seconds = {e["iteration"]: e["seconds"] for e in events(tmp_path / "work" / "events.jsonl", "checkpoint_saved")}
        print(f"[fault matrix] {row.name}: saves of iterations 6 and 8 took {seconds[6]:.2f} s and {seconds[8]:.2f} s "
              f"(iteration 4's: {seconds[4]:.2f} s) with 1 retry each; steps lost 0")
    finally:
        subprocess.run(["umount", str(small)], check=False)
