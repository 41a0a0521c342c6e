"""The in-memory snapshot holder's bookkeeping and the replica placement (no Ray: the actor class
is plain Python; tests/workers/test_ray_recovery.py runs it on a cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.snapshots import KEEP, SnapshotHolder, replica_nodes


def test_holder_keeps_the_newest_per_rank_and_forgets_other_timelines():
    h = SnapshotHolder("job", "node-a")
    for it in (1, 2, 3):
        h.put(0, it, 2, "L", b"rank0-%d" % it)
        h.put(1, it, 2, "L", b"rank1-%d" % it)
    assert KEEP == 2 and h.available(0, 2, "L") == [3, 2]
    assert h.get(1, 3) == b"rank1-3" and h.get(1, 1) is None
    assert h.available(0, 4, "L") == [] and h.available(0, 2, "other layout") == []
    h.forget_after(2)  # the group resumed from 2: 3 belongs to a timeline that was abandoned
    assert h.available(1, 2, "L") == [2]
    h.put(0, 9, 1, "M", b"resized")  # a group of another shape: the old snapshots go
    assert h.available(1, 2, "L") == [] and h.available(0, 1, "M") == [9]


def test_replicas_go_to_the_next_nodes_never_to_the_own_one():
    nodes = ["a", "b", "c"]
    assert replica_nodes("b", nodes, 1) == ["c"]
    assert replica_nodes("c", nodes, 1) == ["a"]
    assert replica_nodes("c", nodes, 5) == ["a", "b"]
    assert replica_nodes("a", ["a", "a"], 1) == []  # one node: own copy only
    assert replica_nodes("a", nodes, 0) == []


def test_a_slot_file_entry_replaces_what_the_holder_listed_under_that_file():
    h = SnapshotHolder("job", "node-a")
    h.put_file(0, 1, 2, "L", "/shm/rank0-slot0.snap", 100)
    h.put_file(0, 2, 2, "L", "/shm/rank0-slot1.snap", 100)
    h.put_file(0, 3, 2, "L", "/shm/rank0-slot0.snap", 120)  # slot 0 rewritten: iteration 1 is gone
    assert h.available(0, 2, "L") == [3, 2]
    assert h.get(0, 3) == {"path": "/shm/rank0-slot0.snap", "nbytes": 120} and h.get(0, 1) is None
    assert h.stats()["bytes"] == 220


def test_slot_files_alternate_and_refuse_a_directory_that_cannot_hold_them(tmp_path, monkeypatch):
    from workers.snapshot_files import SLACK, SlotFiles

    monkeypatch.setenv("ELASTRON_SNAPSHOT_DIR", str(tmp_path))
    files = SlotFiles("job", 3, slots=2)
    first, m0 = files.buffer(1000)
    files.advance()
    second, m1 = files.buffer(1000)
    files.advance()
    assert (first, second, files.next) == (0, 1, 0) and len(m0) == len(m1) == 1000 + SLACK
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["rank3-slot0.snap", "rank3-slot1.snap"]
    assert files.buffer(500)[1] is m0  # big enough: the same map again
    (tmp_path / "blocked").write_text("a file where the directory should be")
    monkeypatch.setenv("ELASTRON_SNAPSHOT_DIR", str(tmp_path / "blocked"))
    with pytest.raises(OSError):
        SlotFiles("job", 0, slots=2).buffer(1000)


def _through_a_slot_file(directory: str) -> dict:
    """Rank function: capture into a slot file's map, seal, read it back as a restarted rank
    would, restore it; then flip one byte of the file: refused."""
    import torch.distributed as dist

    from engine import parallel_state as ps
    from engine.checkpointing.memory import SnapshotError
    from engine.jobspec import JobSpec
    from engine.training import Trainer
    from tests.engine.parallel_harness import job
    from workers.snapshot_files import SlotFiles, read_slot

    trainer = Trainer(JobSpec.model_validate(job(1, training={"train_iters": 4})))
    trainer.train_step()
    size = len(trainer.capture_snapshot().block)
    files = SlotFiles("job", dist.get_rank(), slots=2)
    slot, buffer = files.buffer(size)
    snap = trainer.capture_snapshot(buffer)
    captured_in_file = snap.block.obj is buffer
    snap.seal()
    blob = read_slot(str(files.paths[slot]), len(snap.block))
    restored = trainer.restore_snapshot(blob)
    with open(files.paths[slot], "r+b") as f:
        f.seek(len(blob) - 5)
        byte = f.read(1)
        f.seek(len(blob) - 5)
        f.write(bytes([byte[0] ^ 1]))
    try:
        trainer.restore_snapshot(read_slot(str(files.paths[slot]), len(blob)))
        refused = None
    except SnapshotError as err:
        refused = str(err)
    ps.destroy_model_parallel()
    return {"in_file": captured_in_file, "restored": restored, "refused": refused}


def test_a_snapshot_captured_into_a_slot_file_restores_and_a_flipped_byte_is_refused(tmp_path):
    from engine.launcher import spawn

    env = {"ELASTRON_SNAPSHOT_DIR": str(tmp_path)}
    (result,) = spawn(_through_a_slot_file, 1, (str(tmp_path),), timeout_s=240, env=env)
    assert result["in_file"] and result["restored"] == 1
    assert (tmp_path / "job" / "rank0-slot0.snap").exists()  # where it was told, not /dev/shm
    assert result["refused"] is not None and "checksum mismatch" in result["refused"]


def test_a_slot_file_is_read_by_the_holder_for_a_rank_on_another_node(tmp_path):
    path = tmp_path / "rank0-slot0.snap"
    path.write_bytes(b"framed-block" + b"\0" * 20)  # the slack after the block is not sent
    h = SnapshotHolder("job", "node-a")
    h.put_file(0, 5, 1, "L", str(path), len(b"framed-block"))
    assert h.get(0, 5) == {"path": str(path), "nbytes": 12}
    assert h.get(0, 5, inline=True) == b"framed-block"
    assert h.get(0, 4, inline=True) is None


def test_the_slot_being_written_is_never_one_the_holder_lists(tmp_path, monkeypatch):
    """A rank pushes step after step (three slots, the holder keeping two): the file the next
    capture writes into is never one a recovery may still choose. With two slots it would be."""
    from workers.snapshot_files import SlotFiles

    monkeypatch.setenv("ELASTRON_SNAPSHOT_DIR", str(tmp_path))
    for slots, safe in ((KEEP + 1, True), (KEEP, False)):
        h, files, clashes = SnapshotHolder("job", "node-a"), SlotFiles(f"job-{slots}", 0, slots=slots), 0
        for iteration in range(1, 8):
            slot, _ = files.buffer(64)
            listed = {h.get(0, i)["path"] for i in h.available(0, 1, "L")}
            clashes += str(files.paths[slot]) in listed
            h.put_file(0, iteration, 1, "L", str(files.paths[slot]), 64)
            files.advance()
        assert (clashes == 0) is safe, (slots, clashes)


def _hold_then_sleep(directory: str) -> None:
    """A stand-in holder process: starts the watcher of `directory`, says so, waits to be killed."""
    import time
    from pathlib import Path

    from workers.snapshot_files import remove_when_gone

    remove_when_gone(Path(directory))
    print("watching", flush=True)
    time.sleep(120)


def test_a_holders_files_go_when_its_process_is_killed(tmp_path):
    """SIGKILL runs no handler: the watcher removes the holder's node directory all the same, and
    the job's directory once no other node's is left in it."""
    import os
    import signal
    import subprocess
    import sys

    from tests.waiting import wait_for

    job = tmp_path / "job"
    for node in ("node-a", "node-b"):
        (job / node).mkdir(parents=True)
        (job / node / "rank0-slot0.snap").write_bytes(b"x" * 64)
    holders = {}
    for node in ("node-a", "node-b"):
        code = f"from tests.workers.test_snapshots import _hold_then_sleep; _hold_then_sleep({str(job / node)!r})"
        holders[node] = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2]
        )
        assert holders[node].stdout.readline().strip() == "watching"
    try:
        os.kill(holders["node-a"].pid, signal.SIGKILL)
        wait_for(lambda: not (job / "node-a").exists(), 10, "node-a's files to go")
        assert (job / "node-b" / "rank0-slot0.snap").exists()  # another holder's: kept
        os.kill(holders["node-b"].pid, signal.SIGKILL)
        wait_for(lambda: not job.exists(), 10, "the job's directory to go")
    finally:
        for proc in holders.values():
            proc.kill()
            proc.wait()
