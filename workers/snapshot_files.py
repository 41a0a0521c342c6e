"""A rank's in-memory snapshots as files in a RAM-backed directory of its node.

Handing a snapshot to the node's holder actor through Ray's object store costs three passes over
it besides the capture (into the store, out of it into the holder, and the pages of a fresh
allocation each time), all of them CPU time the training ranks of the node do not get. For the
own node's copy none of that is needed: the rank captures straight into a memory-mapped file
under /dev/shm (tmpfs: RAM, shared between processes, and it outlives the process that wrote it),
seals it there, and tells the holder which file holds which iteration. The holder owns the
bookkeeping and removes the job's files when the job ends; a restarted rank on the node reads
the file the holder names. Replicas on other nodes still go through the object store.

Files in /dev/shm are RAM that nothing frees unless someone removes them, and a holder killed
with SIGKILL (its driver was: Ray kills the driver's actors, not always gently) runs no handler.
So the files of a job live in a directory per node (`<dir>/<job_id>/<node_id>/`: one holder's,
and several Ray nodes may share one machine's /dev/shm), and each holder starts a watcher
(`remove_when_gone`): a small process that blocks reading a pipe only the holder holds open; the
kernel closes it when the holder dies, however it dies, and the watcher removes the holder's
directory (and the job's, once empty) and exits. The watcher is forked twice, so it is no child
of the holder: Ray kills a worker's children when the worker exits, which would take it down
before it could clean up.

Three files per rank (`slot0`..`slot2`) are written in turn: the two snapshots the holders list
and the one being written, so a slot is never overwritten while a recovery may still choose it
(ranks push at their own pace: the newest step every rank has can be one behind a rank's newest). Space is reserved with
posix_fallocate when a file is (re)sized, so a full tmpfs is an OSError then (the pusher falls
back to the object store) and never a SIGBUS while writing through the map.

`ELASTRON_SNAPSHOT_DIR` names the directory (default /dev/shm/elastron-snapshots where /dev/shm
exists, else the temp directory: a disk then, still working, only slower).
"""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ENV_SNAPSHOT_DIR = "ELASTRON_SNAPSHOT_DIR"
SLACK = 1 << 20  # room for a header that grows (iteration digits, meta) without a resize


def snapshot_dir(job_id: str) -> Path:
    root = os.environ.get(ENV_SNAPSHOT_DIR)
    if not root:
        shm = Path("/dev/shm")
        root = (
            shm / "elastron-snapshots" if shm.is_dir() else Path(tempfile.gettempdir()) / "elastron-snapshots"
        )
    return Path(root) / job_id


def read_slot(path: str, nbytes: int) -> bytes:
    """The first `nbytes` of a slot file (the framed block; the rest is slack)."""
    with open(path, "rb") as f:
        return f.read(nbytes)


def drop_job_files(job_id: str) -> None:
    shutil.rmtree(snapshot_dir(job_id), ignore_errors=True)


# The watcher: forks away (its parent exits at once, so it is re-parented to init), waits for
# end-of-file on stdin (every writer gone: the holder ended), removes the directory, then its
# parent if nothing else is left there.
_WATCHER = (
    "import os, shutil, sys\n"
    "if os.fork():\n"
    "    os._exit(0)\n"
    "os.setsid()\n"
    "while sys.stdin.buffer.read(1 << 16):\n"
    "    pass\n"
    "shutil.rmtree(sys.argv[1], ignore_errors=True)\n"
    "try:\n"
    "    os.rmdir(os.path.dirname(sys.argv[1]))\n"
    "except OSError:\n"
    "    pass\n"
)


def remove_when_gone(directory: Path) -> int:
    """Remove `directory`, then its parent if left empty, once the calling process has ended,
    whatever ends it (SIGKILL too). Returns the write end of the watcher's pipe: keep it open
    (never write to it) for as long as the directory must stay; it is not inherited by the
    process' children."""
    read_end, write_end = os.pipe()  # both close-on-exec: only this process holds the write end
    try:
        starter = subprocess.Popen(
            [sys.executable, "-S", "-c", _WATCHER, str(directory)],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        starter.wait(timeout=30)
    finally:
        os.close(read_end)
    return write_end


class SlotFiles:
    """One rank's slot files, mapped: the capture buffer of every other snapshot."""

    def __init__(self, job_id: str, rank: int, slots: int, node_id: str | None = None):
        # Under the node's holder's directory (`node_id`, see the module docstring).
        self.dir = snapshot_dir(job_id) / node_id if node_id else snapshot_dir(job_id)
        self.paths = [self.dir / f"rank{rank}-slot{k}.snap" for k in range(slots)]
        self._maps: list[mmap.mmap | None] = [None] * slots
        self.next = 0

    def buffer(self, nbytes: int) -> tuple[int, mmap.mmap]:
        """(slot, its map of at least `nbytes`) for the next snapshot. OSError when the directory
        cannot hold it (e.g. ENOSPC on a full /dev/shm)."""
        k = self.next
        m = self._maps[k]
        if m is None or len(m) < nbytes:
            self._maps[k] = None  # an old map still viewed by a snapshot closes when dropped
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            size = nbytes + SLACK
            fd = os.open(self.paths[k], os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
                m = self._maps[k] = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        return k, m

    def advance(self) -> None:
        self.next = (self.next + 1) % len(self.paths)
