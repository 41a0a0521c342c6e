"""One API replica as a process of its own (a real process, so a test can SIGKILL it): the app
(its reconciler included) served by uvicorn on 127.0.0.1:<port> over a shared store, with a
FileLauncher whose launches are files every replica and the test can read.

    python -m tests.service.replica '{"home": ..., "database_url": ..., "port": ..., "launches": ...}'

FileLauncher reports a capacity (so only the scheduler lease's holder launches: one scheduler
among the replicas) and appends each submission to <launches>/submissions.log with the pid that
made it, so the test can count every launch of every job across replicas.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from service.launcher import Launcher, LaunchStatus
from service.scheduling.model import Node


class FileLauncher(Launcher):
    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def submit(self, job_id, spec_json, env, *, submission_id=None):
        try:
            (self.folder / submission_id).mkdir()
        except FileExistsError:  # idempotent per submission id, as Ray's is
            return submission_id
        line = json.dumps({"submission_id": submission_id, "job_id": job_id, "pid": os.getpid()}) + "\n"
        fd = os.open(self.folder / "submissions.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return submission_id

    def status(self, submission_id):
        folder = self.folder / submission_id
        if not folder.exists():
            return LaunchStatus.MISSING
        return LaunchStatus.STOPPED if (folder / "stopped").exists() else LaunchStatus.RUNNING

    def stop(self, submission_id):
        folder = self.folder / submission_id
        if not folder.exists() or (folder / "stopped").exists():
            return False
        (folder / "stopped").touch()
        return True

    def logs(self, submission_id):
        return ""

    async def tail(self, submission_id) -> AsyncIterator[str]:
        return
        yield

    def reachable(self):
        return True

    def capacity(self):
        return [Node("n1", cpus=64, gpus=0)]

    def describe(self):
        return "file launcher"


def submissions(folder: Path) -> list[dict]:
    """Every launch recorded under `folder`, in order."""
    log = folder / "submissions.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def main() -> None:
    import uvicorn

    from service.app import create_app
    from tests.service.conftest import make_settings

    args = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, format=f"replica {os.getpid()} %(name)s: %(message)s")
    settings = make_settings(Path(args["home"]), args["database_url"], args["port"])
    app = create_app(settings, launcher=FileLauncher(Path(args["launches"])), reconcile=True)
    uvicorn.run(app, host="127.0.0.1", port=args["port"], log_level="warning")


if __name__ == "__main__":
    main()
