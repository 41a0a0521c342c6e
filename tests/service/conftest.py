"""Control-plane fixtures: a real API on a loopback port, a throwaway Postgres, tokens.

The API runs as uvicorn in a thread of the test process (so a test can inject a launcher and
restart the API on the same port and database); tests talk to it over HTTP with httpx.
Postgres is a fresh cluster (initdb) in a temporary folder, stopped at the end of the session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from engine.launcher import free_port
from service.app import create_app
from service.launcher import Launcher
from service.settings import Settings
from service.store.db import make_engine, make_sessionmaker
from service.store.migrate import upgrade
from service.store.tokens import create_token
from tests.service.launchers import FakeLauncher
from tests.tools import missing_tool
from tests.waiting import wait_for


class ApiServer:
    """`create_app(settings, launcher=...)` served by uvicorn on 127.0.0.1:<port> in a thread."""

    def __init__(self, settings: Settings, launcher: Launcher, port: int, reconcile: bool = True):
        self.settings, self.launcher, self.port, self.reconcile = settings, launcher, port, reconcile
        self.url = f"http://127.0.0.1:{port}"
        self.app = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ApiServer:
        self.app = create_app(self.settings, launcher=self.launcher, reconcile=self.reconcile)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started or not self._thread.is_alive(), 30, "the API to start")
        assert self._server.started, "the API did not start"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(30)
            assert not self._thread.is_alive(), "the API did not stop"
            self._server = None

    @property
    def ctx(self):
        return self.app.state.ctx


@dataclass
class Env:
    """A running API with three tokens: tenants alice and bob, and an admin (tenant ops)."""

    server: ApiServer
    launcher: Launcher
    settings: Settings
    tokens: dict[str, str]

    def client(self, who: str | None = "alice", token: str | None = None) -> httpx.Client:
        headers = {}
        if token is not None or who is not None:
            headers["Authorization"] = f"Bearer {token if token is not None else self.tokens[who]}"
        return httpx.Client(base_url=self.server.url, headers=headers, timeout=30)

    def job(self, job_id: str, who: str = "alice") -> dict:
        with self.client(who) as c:
            r = c.get(f"/v1/jobs/{job_id}")
            assert r.status_code == 200, r.text
            return r.json()

    def wait_state(self, job_id: str, states: str | tuple[str, ...], timeout_s: float = 30.0) -> dict:
        states = (states,) if isinstance(states, str) else states
        return wait_for(
            lambda: (j := self.job(job_id, "admin"))["state"] in states and j,
            timeout_s,
            f"{job_id} in {states}",
        )


def make_settings(home: Path, database_url: str | None, port: int, **overrides) -> Settings:
    values = dict(
        home=home,
        database_url=database_url,
        api_url=f"http://127.0.0.1:{port}",
        reconcile_interval_s=0.1,
        ray_timeout_s=2.0,
        checkpoint_dir=str(home / "checkpoints"),
        # Fake launchers run no workers that could hear a preemption and stop by themselves:
        # the stop signal goes at once (tests/workers/test_ray_preemption.py covers the rest).
        preempt_grace_s=0.0,
    )
    values.update(overrides)
    return Settings(**values)


def make_tokens(settings: Settings) -> dict[str, str]:
    engine = make_engine(settings.resolved_database_url)
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    tokens = {
        "alice": create_token(sessions, "alice")[1],
        "bob": create_token(sessions, "bob")[1],
        "admin": create_token(sessions, "ops", admin=True)[1],
    }
    engine.dispose()
    return tokens


@pytest.fixture
def start_env(tmp_path) -> Iterator[Callable[..., Env]]:
    """Factory: start an API over a fresh SQLite store (or `database_url`) with a given launcher."""
    servers: list[ApiServer] = []

    def start(
        launcher: Launcher | None = None, database_url: str | None = None, reconcile: bool = True, **overrides
    ) -> Env:
        port = free_port()
        settings = make_settings(tmp_path / f"home-{port}", database_url, port, **overrides)
        tokens = make_tokens(settings)
        launcher = launcher if launcher is not None else FakeLauncher()
        server = ApiServer(settings, launcher, port, reconcile=reconcile).start()
        servers.append(server)
        return Env(server, launcher, settings, tokens)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def env(start_env) -> Env:
    return start_env()


# -- Postgres ---------------------------------------------------------------------------------


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for root in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (root / name).exists():
            return str(root / name)
    return None


class PgCluster:
    """A throwaway Postgres cluster (initdb in a temporary folder, served on a loopback port);
    `restart()` stops and starts it on the same port and data, as an operator's or a crash's
    restart would: every open connection is cut."""

    def __init__(self, initdb: str, pg_ctl: str):
        self.pg_ctl = pg_ctl
        self.root = Path(tempfile.mkdtemp(prefix="elastron-pg-"))
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # postgres refuses to run as root
            shutil.chown(self.root, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.data, self.port = self.root / "data", free_port()
        self.url = f"postgresql+psycopg://elastron@127.0.0.1:{self.port}"
        subprocess.run(
            [*self.as_user, initdb, "-D", str(self.data), "-A", "trust", "-U", "elastron", "--no-sync", "-E", "UTF8"],
            check=True,
            capture_output=True,
        )

    def _ctl(self, *args: str, check: bool = True) -> None:
        subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.data), *args], check=check, capture_output=True)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._ctl("-o", options, "-l", str(self.root / "log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "-w", "stop", check=False)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PgCluster]:
    """The session's throwaway Postgres cluster (see `fresh_pg_db` for a database of one's own)."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        missing_tool("postgres", "PostgreSQL's server binaries (initdb, pg_ctl) are not installed: make test "
                     "installs Debian's postgresql (apt-get install postgresql)")
    cluster = PgCluster(initdb, pg_ctl)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop("immediate")
        shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_url(postgres_cluster) -> str:
    """The throwaway cluster's URL (no database named): `fresh_pg_db` adds a fresh one per use."""
    return postgres_cluster.url


@pytest.fixture
def fresh_pg_db(postgres_url) -> str:
    """A new empty database on the throwaway cluster; returns its SQLAlchemy URL."""
    import sqlalchemy as sa

    name = f"t{os.getpid()}_{time.monotonic_ns()}"
    admin = sa.create_engine(f"{postgres_url}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return f"{postgres_url}/{name}"
