"""The fault matrix's harness: a 2-rank job run by a tiny supervisor (attempts of
engine.launcher.spawn, each resuming from the newest committed checkpoint or in-memory snapshot),
with one fault struck once (in the first attempt that gets that far), and the checks every row
must pass.

A row is (fault, where). Process faults strike one rank with SIGKILL or SIGSTOP at a point of
the step or of a save; a stopped rank is found by the other rank's step watchdog (as on Ray),
which kills its own process, and the supervisor then kills the group. Storage faults come from
outside the ranks: an S3 proxy in front of the moto server (s3_proxy.py), a small file system.

The checks (`check_run`): the job finishes; its records, with a later attempt's record of an
iteration replacing an earlier one (the API's at-least-once rule, service/METRICS.md), are every
iteration exactly once, each loss bitwise the clean run's (CPU); no attempt records an iteration
twice; every checkpoint left is committed and whole (each file's checksums), `latest` names one,
no temp file or unfinished multipart upload remains; and the time to recover (the fault to the
next attempt's first record) is printed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

WATCHDOG_S = 6.0  # a stopped peer is found after this long (steps here take ~0.1 s)
MAX_ATTEMPTS = 5
RANKS = 2


@dataclass(frozen=True)
class Row:
    fault: str  # sigkill | sigstop | s3_500 | s3_503 | s3_slowdown | s3_reset | enospc | api_kill
    where: str  # forward | grad_reduce | async_upload | commit | snapshot_seal | upload | save | before_launch
    at: int = 5  # the iteration the fault strikes in (the step after it, or its save)
    slow: bool = True  # False: runs in `make test`

    @property
    def name(self) -> str:
        return f"{self.fault}-{self.where}"

    @property
    def victim(self) -> int:
        return 0 if self.where == "commit" else 1  # rank 0 alone writes the manifest


def base_spec(path: str, *, async_save: bool = False, local_interval: int | None = None, **checkpoint) -> dict:
    from tests.engine.parallel_harness import job

    return job(
        RANKS,
        name="job",
        training={"global_batch_size": 4, "micro_batch_size": 1, "train_iters": 8},
        checkpoint={
            "path": path,
            "interval": 2,
            "keep": 2,
            "async_save": async_save,
            "local_interval": local_interval,
            "save_retry_backoff_s": 0.2,
            **checkpoint,
        },
    )


# ----------------------------------------------------------------------------- in the ranks
class DirSnapshotStore:
    """A SnapshotStore in a folder shared by the attempts: what a node's holder is on Ray."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _name(self, rank, iteration, world, layout) -> Path:
        return self.root / f"r{rank}-w{world}-{layout}-i{iteration:07d}"

    def put(self, rank, iteration, world_size, layout, blob) -> None:
        tmp = self.root / f".tmp-{rank}-{iteration}"
        tmp.write_bytes(blob)
        os.replace(tmp, self._name(rank, iteration, world_size, layout))

    def available(self, rank, world_size, layout):
        prefix = f"r{rank}-w{world_size}-{layout}-i"
        return {int(p.name[len(prefix):]): ["here"] for p in self.root.iterdir() if p.name.startswith(prefix)}

    def get(self, rank, iteration, where):
        for p in self.root.glob(f"r{rank}-w*-i{iteration:07d}"):
            return p.read_bytes()
        return None

    def is_local(self, where) -> bool:
        return True

    def forget_after(self, iteration) -> None:
        for p in self.root.iterdir():
            if "-i" in p.name and not p.name.startswith(".") and int(p.name.rsplit("-i", 1)[1]) > iteration:
                p.unlink(missing_ok=True)


_STRIKE = threading.Lock()


def _strike(row: Row, work: Path) -> None:
    """The fault itself: note when (once, atomically: several writer threads can get here at
    once), then kill or stop this process."""
    if not _STRIKE.acquire(blocking=False):
        while True:  # another thread is striking this process
            time.sleep(1)
    tmp = work / ".fault_at"
    tmp.write_text(json.dumps({"ts": time.time(), "row": row.name}))
    os.replace(tmp, work / "fault_at")
    os.kill(os.getpid(), signal.SIGKILL if row.fault == "sigkill" else signal.SIGSTOP)


def _arm(row: Row, box: dict, work: Path) -> None:
    """Install the row's strike point in this (victim) rank process."""
    import torch.distributed as dist

    from engine.checkpointing import local_storage as ls
    from engine.checkpointing import memory

    def iteration_of(key: str) -> int | None:
        folder = next((p for p in key.split("/") if p.startswith("iter_")), None)
        return int(folder[5:]) if folder else None

    if row.where == "forward":

        def pre_forward(t) -> None:
            if t.iteration == row.at - 1:
                _strike(row, work)

        box["pre_forward"] = pre_forward
    elif row.where == "grad_reduce":
        for name in ("all_reduce", "reduce_scatter_tensor"):
            real = getattr(dist, name)

            def wrapped(tensor, *args, _real=real, **kwargs):
                t = box.get("trainer")
                if (
                    t is not None
                    and t.iteration == row.at - 1
                    and t.phase in ("forward-backward", "grads-finalize")
                    and tensor.numel() > 1
                ):
                    _strike(row, work)
                return _real(tensor, *args, **kwargs)

            setattr(dist, name, wrapped)
    elif row.where == "async_upload":
        real_open = ls.LocalStorage.open_write

        def open_write(storage, key):
            stream = real_open(storage, key)
            if iteration_of(key) == row.at and key.endswith(".distcp"):
                real_write = stream.write

                def write(data):
                    real_write(data)
                    _strike(row, work)  # some bytes out, the upload unfinished

                stream.write = write
            return stream

        ls.LocalStorage.open_write = open_write
    elif row.where == "commit":
        real_put = ls.LocalStorage.put_bytes

        def put_bytes(storage, key, data):
            if key.endswith("/manifest.json") and iteration_of(key) == row.at:
                _strike(row, work)
            return real_put(storage, key, data)

        ls.LocalStorage.put_bytes = put_bytes
    elif row.where == "snapshot_seal":
        real_seal = memory.HostSnapshot.seal

        def seal(self):
            if self.iteration == row.at:
                _strike(row, work)
            return real_seal(self)

        memory.HostSnapshot.seal = seal


def matrix_rank(spec_dict: dict, row: Row | None, attempt: int, workdir: str) -> dict:
    """One rank of one attempt: train the job (resuming as it says), rank 0's records to
    records-<attempt>.jsonl as they are handed on (what telemetry would have sent)."""
    import torch.distributed as dist

    from engine.checkpointing.checkpointer import layout_signature
    from engine.checkpointing.recovery import recover
    from engine.rank_hooks import RankHooks
    from engine.train_loop import train_rank
    from engine.watchdog import StepWatchdog

    work, rank = Path(workdir), dist.get_rank()
    box: dict = {}
    # Armed until it has struck once (an attempt can fail before, e.g. a port taken meanwhile).
    struck = (work / "fault_at").exists()
    if row is not None and not struck and row.fault in ("sigkill", "sigstop") and rank == row.victim:
        _arm(row, box, work)
    store = DirSnapshotStore(work / f"snapshots-{rank}") if spec_dict["checkpoint"].get("local_interval") else None
    dog = StepWatchdog(WATCHDOG_S, setup_timeout_s=240, stream=open(os.devnull, "w")).start()  # noqa: SIM115
    out = open(work / f"records-{attempt}.jsonl", "a") if rank == 0 else None  # noqa: SIM115

    def on_trainer(t) -> None:
        box["trainer"] = t
        if store is not None:
            got = recover(t, store)
            if rank == 0:
                (work / f"recovered-{attempt}.json").write_text(json.dumps(got))
        if "pre_forward" in box:
            t.model_chunks[0].register_forward_pre_hook(lambda *_: box["pre_forward"](t))
        dog.watch(t)

    def on_record(rec: dict) -> None:
        out.write(json.dumps({"iteration": rec["iteration"], "loss": rec["loss"], "ts": time.time()}) + "\n")
        out.flush()

    def on_snapshot_due(t) -> None:
        snap = t.capture_snapshot()
        store.put(rank, t.iteration, dist.get_world_size(), layout_signature(t.spec.parallel), bytes(snap.seal()))

    try:
        train_rank(
            spec_dict,
            quiet=True,
            events_out=str(work / "events.jsonl"),
            hooks=RankHooks(
                on_trainer=on_trainer,
                on_record=on_record if out is not None else None,
                on_snapshot_due=on_snapshot_due if store is not None else None,
            ),
        )
    finally:
        dog.stop()
        if out is not None:
            out.close()
    return {}


# ----------------------------------------------------------------------------- the supervisor
@dataclass
class Run:
    attempts: list[list[tuple[int, float, float]]]  # per attempt: (iteration, loss, ts)
    finished: bool
    fault_at: float | None
    seconds: float
    failures: list[str]  # why each failed attempt failed

    @property
    def merged(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for records in self.attempts:
            for it, loss, _ts in records:
                out[it] = loss  # a later attempt's record replaces an earlier one
        return out

    @property
    def recover_s(self) -> float | None:
        """The fault to the first record after it of a later attempt."""
        if self.fault_at is None:
            return None
        later = [ts for records in self.attempts[1:] for _it, _loss, ts in records if ts > self.fault_at]
        return min(later) - self.fault_at if later else None


def supervise(spec: dict, row: Row | None, workdir: Path, env: dict | None = None) -> Run:
    from engine.launcher import RankFailure, spawn

    workdir.mkdir(parents=True, exist_ok=True)
    started, finished, attempt, failures = time.perf_counter(), False, 0, []
    for attempt in range(MAX_ATTEMPTS):
        try:
            spawn(matrix_rank, RANKS, (spec, row, attempt, str(workdir)), timeout_s=180, grace_s=2, env=env)
            finished = True
            break
        except RankFailure as err:
            failures.append(str(err)[-2000:])
            continue
    attempts = []
    for a in range(attempt + 1):
        path = workdir / f"records-{a}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        attempts.append([(r["iteration"], r["loss"], r["ts"]) for r in map(json.loads, lines)])
    fault = workdir / "fault_at"
    fault_at = json.loads(fault.read_text())["ts"] if fault.exists() else None
    return Run(attempts, finished, fault_at, time.perf_counter() - started, failures)


# ----------------------------------------------------------------------------- the checks
def check_run(run: Run, clean: dict[int, float], label: str) -> None:
    assert run.finished, f"{label}: the job did not finish in {MAX_ATTEMPTS} attempts"
    for a, records in enumerate(run.attempts):
        its = [it for it, _loss, _ts in records]
        assert len(its) == len(set(its)), f"{label}: attempt {a} recorded an iteration twice: {its}"
    assert run.merged == clean, f"{label}: records {run.merged} differ from the clean run's {clean}"


def check_storage(storage, job_root: str, train_iters: int) -> None:
    """Every checkpoint left is committed and whole; `latest` is the final one."""
    import tempfile

    from engine.checkpointing.commit import _iter_folders, latest_checkpoint, open_checkpoint, read_manifest

    folders = _iter_folders(storage, job_root)
    assert folders and all(folders.values()), f"uncommitted (partial) checkpoint folders: {folders}"
    raw = storage.get_bytes(f"{job_root}/latest").decode()
    assert raw == f"{train_iters}\n" and latest_checkpoint(storage, job_root) == train_iters, raw
    with tempfile.TemporaryDirectory() as cache:
        for it in folders:
            names = [f["name"] for f in read_manifest(storage, job_root, it)["files"]]
            open_checkpoint(storage, job_root, it, Path(cache), check_now=names)  # every checksum
    local = storage.local_path(job_root)
    if local is not None:
        temps = [p for p in Path(local).rglob(".elastron-tmp-*")]
        assert not temps, f"temp files left: {temps}"
