"""Launcher test doubles.

FakeLauncher: in memory, every answer set by the test (statuses, reachability, failures, and the
cluster's capacity: `nodes`, None by default, so the reconciler launches in order as without a
scheduler).
ProcessLauncher: runs each submission as a detached local process (tests/service/detached.py)
whose state lives in files, so its jobs outlive the API instance that launched them, like Ray
jobs: the API-restart tests use it.
Both implement `submit_command` (checkpoint exports): FakeLauncher records the command,
ProcessLauncher runs it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from service.launcher import Launcher, LauncherUnavailable, LaunchStatus

HERE = Path(__file__).resolve().parent
FAKE_WORKER = [sys.executable, str(HERE / "fake_worker.py")]


class FakeLauncher(Launcher):
    def __init__(self) -> None:
        self.up = True
        self.submissions: dict[str, dict] = {}
        self.stopped: list[str] = []
        self.reject_with: Exception | None = None
        self.messages: dict[str, str] = {}
        self.tails = 0
        self.break_tail_after: int | None = None  # the next log stream breaks after this many lines
        self.nodes: list | None = None  # capacity(): None = unknown (no scheduling)
        self.logs_of: dict[str, str] = {}  # a submission's log, where a test sets one

    def _check(self) -> None:
        if not self.up:
            raise LauncherUnavailable("fake Ray is down")

    def submit(self, job_id, spec_json, env, *, submission_id=None):
        self._check()
        if self.reject_with is not None:
            raise self.reject_with
        self.submissions[submission_id] = {"job_id": job_id, "env": dict(env), "status": LaunchStatus.PENDING}
        return submission_id

    def submit_command(self, submission_id, entrypoint, env, *, resources=None):
        self._check()
        if self.reject_with is not None:
            raise self.reject_with
        if submission_id not in self.submissions:  # idempotent, as Ray's is
            self.submissions[submission_id] = {
                "job_id": None,
                "entrypoint": entrypoint,
                "env": dict(env),
                "status": LaunchStatus.PENDING,
                "resources": resources,
            }
        return submission_id

    def status(self, submission_id):
        self._check()
        entry = self.submissions.get(submission_id)
        return entry["status"] if entry else LaunchStatus.MISSING

    def message(self, submission_id):
        return self.messages.get(submission_id)

    def exit_code(self, submission_id):
        return self.submissions.get(submission_id, {}).get("exit_code")

    def set_status(
        self, submission_id, status: LaunchStatus, message: str | None = None, exit_code: int | None = None
    ) -> None:
        self.submissions[submission_id]["status"] = status
        self.submissions[submission_id]["exit_code"] = exit_code
        if message:
            self.messages[submission_id] = message

    def stop(self, submission_id):
        self._check()
        self.stopped.append(submission_id)
        entry = self.submissions.get(submission_id)
        if entry is None or entry["status"] in (
            LaunchStatus.SUCCEEDED,
            LaunchStatus.FAILED,
            LaunchStatus.STOPPED,
        ):
            return False
        entry["status"] = LaunchStatus.STOPPED
        return True

    def logs(self, submission_id):
        self._check()
        return self.logs_of.get(submission_id, f"log of {submission_id}\n")

    async def tail(self, submission_id) -> AsyncIterator[str]:
        self._check()
        self.tails += 1
        for i in range(3):
            if self.break_tail_after is not None and i == self.break_tail_after:
                self.break_tail_after = None  # once
                raise LauncherUnavailable("fake log stream broke")
            yield f"line {i} of {submission_id}\n"

    def reachable(self):
        return self.up

    def capacity(self):
        self._check()
        return None if self.nodes is None else list(self.nodes)

    def describe(self):
        return "fake Ray"

    def env_of(self, job_id: str) -> dict[str, str]:
        return next(s["env"] for s in reversed(list(self.submissions.values())) if s["job_id"] == job_id)


class ProcessLauncher(Launcher):
    def __init__(
        self, state_dir: Path, command: list[str] | None = None, extra_env: dict[str, str] | None = None
    ):
        self.state_dir = state_dir
        self.command = command or FAKE_WORKER
        self.extra_env = extra_env or {}
        state_dir.mkdir(parents=True, exist_ok=True)
        self.wrappers: list[subprocess.Popen] = []

    def _dir(self, submission_id: str) -> Path:
        return self.state_dir / submission_id

    def submit(self, job_id, spec_json, env, *, submission_id=None):
        return self._start(submission_id, self.command, env)

    def submit_command(self, submission_id, entrypoint, env, *, resources=None):
        """Really runs `entrypoint` (argv, or a shell command line) as a detached process."""
        argv = ["/bin/sh", "-c", entrypoint] if isinstance(entrypoint, str) else list(entrypoint)
        return self._start(submission_id, argv, env)

    def _start(self, submission_id: str, argv: list[str], env: dict[str, str]) -> str:
        folder = self._dir(submission_id)
        if folder.exists():
            return submission_id
        folder.mkdir()
        full_env = {**os.environ, **env, **self.extra_env}
        self.wrappers.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "detached.py"), str(folder), *argv],
                env=full_env,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        )
        return submission_id

    def status(self, submission_id):
        folder = self._dir(submission_id)
        if not folder.exists():
            return LaunchStatus.MISSING
        rc = folder / "rc"
        if not rc.exists():
            return LaunchStatus.RUNNING
        if (folder / "stopped").exists():
            return LaunchStatus.STOPPED
        return LaunchStatus.SUCCEEDED if rc.read_text().strip() == "0" else LaunchStatus.FAILED

    def message(self, submission_id):
        code = self.exit_code(submission_id)
        return None if code is None else f"exit code {code}"

    def exit_code(self, submission_id):
        rc = self._dir(submission_id) / "rc"
        return int(rc.read_text().strip()) if rc.exists() else None

    def stop(self, submission_id):
        folder = self._dir(submission_id)
        if not (folder / "pid").exists() or (folder / "rc").exists():
            return False
        (folder / "stopped").touch()
        try:
            os.kill(int((folder / "pid").read_text()), signal.SIGINT)
        except ProcessLookupError:
            return False
        return True

    def logs(self, submission_id):
        try:
            return (self._dir(submission_id) / "log").read_text()
        except FileNotFoundError:
            return ""

    async def tail(self, submission_id) -> AsyncIterator[str]:
        folder, offset = self._dir(submission_id), 0
        while True:
            done = (folder / "rc").exists()
            text = self.logs(submission_id)
            if len(text) > offset:
                yield text[offset:]
                offset = len(text)
            if done:
                return
            await asyncio.sleep(0.1)

    def reachable(self):
        return not (self.state_dir / "unreachable").exists()

    def kill_all(self) -> None:
        """Test teardown: end every process this launcher started."""
        for folder in self.state_dir.iterdir():
            pid_file = folder / "pid"
            if pid_file.exists() and not (folder / "rc").exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for wrapper in self.wrappers:
            try:
                wrapper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                wrapper.kill()
