"""A real full disk (issue 34): a tmpfs just big enough for one checkpoint, mounted for the test.

The injected ENOSPC of test_save_failures.py runs everywhere; this one needs root (mount), as on
CI's container, and skips elsewhere, naming what is missing. The first save commits; every later
one runs out of space part way through its shards, is retried, cleaned up and skipped: the job
finishes bitwise as the clean run, no partial folder or temp file remains, the space is given
back, and `latest` still names the one commit.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from engine.launcher import spawn
from tests.faults.inject import leftovers
from tests.faults.run import events, train_with_faults
from tests.faults.test_save_failures import _spec


@pytest.fixture
def small_fs(tmp_path):
    """A mount point; the test mounts it once it knows the size it needs."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to mount a small tmpfs")
    where = tmp_path / "small"
    where.mkdir()
    mounted = []

    def mount(size: int):
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"mount -t tmpfs failed (no CAP_SYS_ADMIN?): {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for m in mounted:
        subprocess.run(["umount", str(m)], check=False)


def test_a_full_disk_leaves_one_clean_commit_and_training_goes_on(tmp_path, small_fs):
    ref_events = str(tmp_path / "ref.jsonl")
    clean = spawn(train_with_faults, 2, (_spec(tmp_path / "ref"), None, ref_events), timeout_s=240)[0]
    size = max(e["bytes"] for e in events(ref_events, "checkpoint_saved"))
    # Room for one checkpoint and half of the next (tmpfs rounds to pages; files are a few).
    root = small_fs(((size * 3 // 2) // 4096 + 4) * 4096)
    ev = str(tmp_path / "events.jsonl")
    spec = _spec(root, max_consecutive_failures=10, save_retries=1)
    out = spawn(train_with_faults, 2, (spec, None, ev), timeout_s=240)[0]
    assert out["error"] is None
    assert out["records"] == clean["records"]  # every iteration once, bitwise
    assert [e["iteration"] for e in events(ev, "checkpoint_saved")] == [2]
    failed = events(ev, "checkpoint_failed")
    assert [e["iteration"] for e in failed] == [4, 6, 8]
    assert all("No space left on device" in e["message"] for e in failed)
    assert leftovers(root) == {"iter_0000002": leftovers(tmp_path / "ref")["iter_0000008"]}  # same files
    assert (root / "job" / "latest").read_text() == "2\n"
    used = shutil.disk_usage(root).used
    assert used < size + 64 * 1024, f"{used} bytes still used: the failed saves' space was not given back"
