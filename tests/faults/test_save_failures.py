"""A failed persistent save never stops training by itself (issue 34): it is retried with
backoff, then skipped with a `checkpoint_failed` event; after
`checkpoint.max_consecutive_failures` failures in a row (or at once, with `on_save_failure:
fail`) the job stops with a `CheckpointStorageError` naming the storage error, which the workers'
restart policy does not restart. A failed attempt leaves nothing of its iteration behind and
never touches `latest`. Faults are injected at LocalStorage's write layer (tests/faults/inject.py);
test_small_filesystem.py fills a real small file system.
"""

from __future__ import annotations

import errno

import pytest

from engine.checkpointing.save_failures import CheckpointStorageError, SaveFailures, describe, no_space
from engine.launcher import spawn
from tests.engine.parallel_harness import job
from tests.faults.inject import StorageFaults, leftovers
from tests.faults.run import events, train_with_faults


def _spec(path, ranks: int = 2, **checkpoint) -> dict:
    return job(
        ranks,
        name="job",
        training={"global_batch_size": 4, "micro_batch_size": 1, "train_iters": 8},
        checkpoint={"path": str(path), "interval": 2, "save_retry_backoff_s": 0.0, **checkpoint},
    )


def _run(tmp_path, spec: dict, faults: StorageFaults | None, ranks: int = 2) -> tuple[dict, str]:
    ev = str(tmp_path / "events.jsonl")
    return spawn(train_with_faults, ranks, (spec, faults, ev), timeout_s=240)[0], ev


def _latest(root) -> str:
    return (root / "job" / "latest").read_text()


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    return _run(root, _spec(root / "ckpt"), None)[0]["records"]


def test_a_save_failing_on_one_rank_is_retried_then_skipped_and_training_goes_on(tmp_path, clean):
    """Rank 1's disk is full for iteration 4's save: every attempt fails on that rank only, yet
    every rank retries and skips together; training finishes bitwise as the clean run, and
    iteration 4 left no file, no temp file and no `latest` behind."""
    root = tmp_path / "ckpt"
    faults = StorageFaults(iterations=(4,), ranks=(1,))
    out, ev = _run(tmp_path, _spec(root, save_retries=2), faults)
    assert out["error"] is None
    assert out["records"] == clean  # every iteration once, losses bitwise
    failed = events(ev, "checkpoint_failed")
    assert [(e["iteration"], e["retries"], e["skipped"], e["consecutive"]) for e in failed] == [(4, 2, True, 1)]
    assert "No space left on device" in failed[0]["message"] and "rank 1" in failed[0]["message"]
    assert [e["iteration"] for e in events(ev, "checkpoint_saved")] == [2, 6, 8]
    assert "iter_0000004" not in leftovers(root)
    assert all(not n.startswith(".elastron-tmp") for files in leftovers(root).values() for n in files)
    assert _latest(root) == "8\n"


def test_a_transient_failure_is_retried_and_the_checkpoint_commits(tmp_path, clean):
    root = tmp_path / "ckpt"
    faults = StorageFaults(iterations=(4,), target="manifest", error=errno.EIO, attempts=1)
    out, ev = _run(tmp_path, _spec(root), faults)
    assert out["error"] is None and out["records"] == clean
    assert not events(ev, "checkpoint_failed")
    saved = {e["iteration"]: e["retries"] for e in events(ev, "checkpoint_saved")}
    assert saved == {2: 0, 4: 1, 6: 0, 8: 0}


def test_latest_that_cannot_be_written_uncommits_the_checkpoint(tmp_path, clean):
    """The manifest of iteration 4 is written but `latest` is not: the save counts as failed and
    its folder goes (manifest first), so no committed checkpoint is newer than `latest` says."""
    root = tmp_path / "ckpt"
    spec = _spec(root, save_retries=0, keep=5)
    out, ev = _run(tmp_path, spec, StorageFaults(iterations=(4,), target="latest", error=errno.EDQUOT))
    assert out["error"] is None and out["records"] == clean
    assert [e["iteration"] for e in events(ev, "checkpoint_failed")] == [4]
    assert sorted(leftovers(root)) == ["iter_0000002", "iter_0000006", "iter_0000008"]
    assert _latest(root) == "8\n"


@pytest.mark.parametrize("async_save", [False, True])
def test_consecutive_failures_stop_the_job_naming_the_storage_error(tmp_path, async_save):
    """Every save fails: the job stops at the second one (max_consecutive_failures 2) with an
    error naming the cause and the field, after exactly the iterations it trained."""
    root = tmp_path / "ckpt"
    spec = _spec(root, save_retries=1, max_consecutive_failures=2, async_save=async_save)
    out, ev = _run(tmp_path, spec, StorageFaults(iterations=(2, 4, 6, 8)))
    assert out["error"] is not None and out["error"].startswith("CheckpointStorageError")
    assert "max_consecutive_failures = 2" in out["error"] and "No space left on device" in out["error"]
    failed = events(ev, "checkpoint_failed")
    assert [(e["iteration"], e["skipped"]) for e in failed] == [(2, True), (4, False)]
    # A synchronous save stops the job at iteration 4; an async one learns of the second failure
    # when the next save (6) waits for it.
    assert [it for it, _ in out["records"]] == list(range(1, 5 if not async_save else 7))
    assert leftovers(root) == {}


def test_on_save_failure_fail_stops_at_the_first_failed_save(tmp_path):
    root = tmp_path / "ckpt"
    spec = _spec(root, on_save_failure="fail", save_retries=0)
    out, _ = _run(tmp_path, spec, StorageFaults(iterations=(4,), target="metadata"), ranks=1)
    assert "on_save_failure: fail" in out["error"] and "No space left on device" in out["error"]
    assert [it for it, _ in out["records"]] == [1, 2, 3, 4]
    assert sorted(leftovers(root)) == ["iter_0000002"]


def test_async_saves_skip_and_go_on(tmp_path, clean):
    root = tmp_path / "ckpt"
    out, ev = _run(tmp_path, _spec(root, async_save=True), StorageFaults(iterations=(2, 6)))
    assert out["error"] is None and out["records"] == clean
    assert [e["iteration"] for e in events(ev, "checkpoint_failed")] == [2, 6]
    assert sorted(leftovers(root)) == ["iter_0000004", "iter_0000008"]


def test_the_policy_counts_failures_in_a_row_and_backs_off():
    p = SaveFailures("continue", retries=3, backoff_s=2.0, max_consecutive=2)
    assert [p.delay(i) for i in (1, 2, 3)] == [2.0, 4.0, 8.0]
    assert p.failed(2, "OSError: disk full") is None
    p.succeeded()
    assert p.failed(4, "OSError: disk full") is None
    stop = p.failed(6, "OSError: disk full")
    assert isinstance(stop, CheckpointStorageError) and stop.failures == 2
    import pickle

    again = pickle.loads(pickle.dumps(stop))
    assert str(again) == str(stop) and again.storage_error == "OSError: disk full"


def test_errors_are_named_through_dcps_wrapper():
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("write", {1: (full, "traceback")})
    assert describe(wrapped) == "rank 1: OSError: [Errno 28] No space left on device"
    assert no_space(wrapped) and not no_space(OSError(errno.EIO, "I/O error"))


def _slow_saves(spec_dict: dict, faults: StorageFaults) -> dict:
    """Rank function: async saves every iteration on storage slower than a step. Counts saves in
    flight at once and the host buffers' memory across saves."""
    import threading

    import torch.distributed as dist

    from engine import parallel_state as ps
    from engine.checkpointing.checkpointer import Checkpointer
    from engine.train_loop import train_rank

    faults.install()
    lock, state = threading.Lock(), {"now": 0, "most": 0, "buffers": set(), "saves": 0}
    real = Checkpointer._save_with_retries

    def counted(self, *args, **kwargs):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            state["saves"] += 1
            state["buffers"].add(tuple(sorted((k, v.data_ptr()) for k, v in self._host_buffers.items())))
        try:
            return real(self, *args, **kwargs)
        finally:
            with lock:
                state["now"] -= 1

    Checkpointer._save_with_retries = counted
    train_rank(spec_dict, quiet=True)
    ps.destroy_model_parallel()
    state.pop("now")
    state["buffer_sets"] = len(state.pop("buffers"))
    return state if dist.get_rank() == 0 else {}


def test_a_save_slower_than_the_interval_is_waited_for_never_stacked(tmp_path):
    """Each save takes longer than a step: the next save waits for it (every interval's
    checkpoint commits), never two in flight, and the host copy is the same memory every time."""
    root = tmp_path / "ckpt"
    spec = _spec(root, interval=1, async_save=True, keep=10)
    got = spawn(_slow_saves, 2, (spec, StorageFaults(iterations=tuple(range(1, 9)), delay_s=0.05)), timeout_s=240)[0]
    assert got == {"most": 1, "saves": 8, "buffer_sets": 1}
    assert sorted(leftovers(root)) == [f"iter_{i:07d}" for i in range(1, 9)]
