"""The store on a real Postgres, under the failures a deployment meets (issue 61):

- two API replicas (real processes, tests/service/replica.py) share one Postgres; the one holding
  the scheduler lease is SIGKILLed: the other takes the lease over and launches what comes next,
  and no job is launched twice (every launch is a line in the FileLauncher's shared log);
- Postgres is restarted under a running API: requests succeed right after it, the jobs from
  before are all there and not relaunched, and a job submitted after is launched (the
  reconciler took its scheduler lease back on a new session);
- a database at 0004_resize holding jobs, events, metrics, checkpoints and exports is upgraded
  to the newest revision (whatever 0005+ add) on SQLite and on Postgres, and the API serves the
  old rows unchanged (on SQLite a table rebuild used to cascade-delete every job's events,
  metrics, checkpoints and exports: service/store/migrate.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from engine.launcher import free_port
from service.launcher import LaunchStatus
from service.scheduling.model import Node
from service.store import migrate
from service.store.db import make_engine
from tests.service.conftest import make_settings, make_tokens
from tests.service.launchers import FakeLauncher
from tests.service.replica import submissions
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def spec(name: str) -> dict:
    return {
        "name": name,
        "training": {"train_iters": 8, "global_batch_size": 8},
        "resources": {"ranks": 1, "device": "cpu"},
    }


def submit(url: str, token: str, name: str) -> str:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        r = c.post("/v1/jobs", json=spec(name))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def get_job(url: str, token: str, job_id: str) -> dict:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        r = c.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


# -- two replicas, the lease holder SIGKILLed ---------------------------------------------------------


class Replica:
    """tests/service/replica.py as a child process: an API and its reconciler over `database_url`."""

    def __init__(self, tmp_path: Path, name: str, database_url: str, launches: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"{name}.log"
        args = {"home": str(tmp_path / name), "database_url": database_url, "port": self.port,
                "launches": str(launches)}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.service.replica", json.dumps(args)],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_for(lambda: self.proc.poll() is not None or self._answers(), 120, f"replica {name} to answer")
        assert self.proc.poll() is None, self.log.read_text()

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture
def replicas():
    started: list[Replica] = []

    def start(*args) -> Replica:
        started.append(Replica(*args))
        return started[-1]

    yield start
    for replica in started:
        replica.kill()


def launched(launches: Path, job_id: str) -> list[dict]:
    return [s for s in submissions(launches) if s["job_id"] == job_id]


def test_a_sigkilled_lease_holder_is_replaced_and_no_job_launches_twice(fresh_pg_db, replicas, tmp_path):
    tokens = make_tokens(make_settings(tmp_path / "setup", fresh_pg_db, 0))
    alice = tokens["alice"]
    launches = tmp_path / "launches"
    first = replicas(tmp_path, "first", fresh_pg_db, launches)
    before = submit(first.url, alice, "before")
    wait_for(lambda: launched(launches, before), 60, "the first replica to launch a job")
    second = replicas(tmp_path, "second", fresh_pg_db, launches)

    # Submitted through the second replica, launched by the first: it holds the lease.
    both_up = submit(second.url, alice, "both-up")
    (launch,) = wait_for(lambda: launched(launches, both_up), 60, "a launch with two replicas up")
    assert launch["pid"] == first.proc.pid
    assert {s["pid"] for s in submissions(launches)} == {first.proc.pid}

    first.kill()  # no shutdown: its Postgres session ends when the kernel closes the socket
    after = submit(second.url, alice, "after")
    (launch,) = wait_for(lambda: launched(launches, after), 60, "the second replica to take the lease over")
    assert launch["pid"] == second.proc.pid

    # The first replica's launches are watched, not launched again, by the second.
    for job_id in (before, both_up):
        job = get_job(second.url, alice, job_id)
        assert job["state"] in ("starting", "running") and job["attempt"] == 1, job
        assert job["submission_id"] == f"elastron-{job_id}-1"
    counts = Counter(s["job_id"] for s in submissions(launches))
    assert counts == {before: 1, both_up: 1, after: 1}, submissions(launches)
    assert second.proc.poll() is None, second.log.read_text()


# -- Postgres restarted under a running API -----------------------------------------------------------


def test_the_api_recovers_from_a_postgres_restart(start_env, fresh_pg_db, postgres_cluster):
    launcher = FakeLauncher()
    launcher.nodes = [Node("n1", cpus=8, gpus=0)]  # scheduled: the reconciler uses the lease
    env = start_env(launcher, database_url=fresh_pg_db)
    with env.client() as c:
        before = [c.post("/v1/jobs", json=spec(f"before-{i}")).json()["id"] for i in range(3)]
    for job_id in before:
        env.wait_state(job_id, "starting")
        launcher.set_status(env.job(job_id)["submission_id"], LaunchStatus.RUNNING)
    assert env.server.ctx.reconciler.lease._conn is not None  # the lease's own session is open

    postgres_cluster.restart()  # every connection the API holds is cut

    with env.client() as c:
        r = c.get("/v1/jobs")  # the first request after the restart
        assert r.status_code == 200, r.text
        assert {j["id"] for j in r.json()["jobs"]} >= set(before)
        r = c.post("/v1/jobs", json=spec("after"))
        assert r.status_code == 201, r.text
        after = r.json()["id"]
    env.wait_state(after, "starting")  # the reconciler scheduled again: it took the lease back
    with env.client(None) as anonymous:
        wait_for(lambda: anonymous.get("/readyz").status_code == 200, 30, "/readyz to answer 200")
    for job_id in before:
        job = env.job(job_id)
        assert job["state"] == "starting" and job["attempt"] == 1, job
    counts = Counter(s["job_id"] for s in launcher.submissions.values())
    assert counts == {**dict.fromkeys(before, 1), after: 1}


# -- a database holding data migrated to the newest revision ------------------------------------------


def _alembic(conn: sa.Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrate.MIGRATIONS))
    config.attributes["connection"] = conn
    return config


OLD_SPEC = {"name": "old", "training": {"train_iters": 8, "global_batch_size": 8},
            "resources": {"ranks": 1, "device": "cpu"}}


def _fill_at_0004(engine: sa.Engine) -> None:
    """Rows as the API of revision 0004_resize wrote them: a finished job with its events, metrics,
    a checkpoint and an export; a queued job with a priority."""
    now = time.time()
    job = dict(tenant="alice", spec=json.dumps(OLD_SPEC), created_at=now - 60, updated_at=now - 10, attempt=1,
               launch_failures=0, train_iters=8, iteration_epoch=0, restarts=0, stats="{}", version=3,
               priority=0, preemptible=True, waited_s=1.5)
    with engine.begin() as conn:
        insert = sa.text(
            "INSERT INTO jobs (id, tenant, name, spec, state, created_at, updated_at, attempt, launch_failures,"
            " train_iters, current_iteration, iteration_epoch, restarts, stats, version, priority, preemptible,"
            " waited_s, submission_id, latest_checkpoint) VALUES (:id, :tenant, :name, :spec, :state,"
            " :created_at, :updated_at, :attempt, :launch_failures, :train_iters, :current_iteration,"
            " :iteration_epoch, :restarts, :stats, :version, :priority, :preemptible, :waited_s,"
            " :submission_id, :latest_checkpoint)"
        )
        conn.execute(insert, dict(job, id="old-done", name="done", state="succeeded", current_iteration=8,
                                  submission_id="elastron-old-done-1",
                                  latest_checkpoint=json.dumps({"iteration": 8, "uri": "file:///ckpt/8"})))
        conn.execute(insert, dict(job, id="old-queued", name="queued", state="queued", current_iteration=None,
                                  submission_id=None, latest_checkpoint=None, priority=7, version=1))
        for i, kind in enumerate(["submitted", "launch", "finished"]):
            conn.execute(
                sa.text("INSERT INTO job_events (job_id, ts, recorded_at, kind, message, data)"
                        " VALUES ('old-done', :ts, :ts, :kind, :msg, '{}')"),
                {"ts": now - 50 + i, "kind": kind, "msg": f"{kind} message"},
            )
        for it in range(1, 9):
            conn.execute(
                sa.text("INSERT INTO job_metrics (job_id, iteration, epoch, recorded_at, record)"
                        " VALUES ('old-done', :it, 0, :ts, :rec)"),
                {"it": it, "ts": now - 40 + it, "rec": json.dumps({"iteration": it, "loss": 10.0 - it})},
            )
        conn.execute(sa.text("INSERT INTO job_checkpoints (job_id, iteration, uri, bytes, seconds, result, ts)"
                             " VALUES ('old-done', 8, 'file:///ckpt/8', 1234, 0.5, 'ok', :ts)"), {"ts": now - 20})
        conn.execute(sa.text("INSERT INTO job_exports (id, job_id, iteration, format, dtype, source, output, status,"
                             " submission_id, created_at) VALUES ('exp-old', 'old-done', 8, 'hf', 'bf16',"
                             " 'file:///ckpt/8', 'file:///out', 'succeeded', 'export-old', :ts)"), {"ts": now - 5})


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'old.db'}"
    return request.getfixturevalue("fresh_pg_db")


def test_a_database_holding_jobs_migrates_to_the_newest_revision(database_url, start_env):
    engine = make_engine(database_url)
    with engine.begin() as conn:
        command.upgrade(_alembic(conn), "0004_resize")
    assert migrate.current_revision(engine) == "0004_resize"
    _fill_at_0004(engine)

    assert migrate.upgrade(engine)  # what an API start runs
    with engine.connect() as conn:
        newest = ScriptDirectory.from_config(_alembic(conn)).get_current_head()
    assert migrate.current_revision(engine) == newest == migrate.HEAD
    with engine.connect() as conn:
        counts = {t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar()
                  for t in ("jobs", "job_events", "job_metrics", "job_checkpoints", "job_exports")}
    assert counts == {"jobs": 2, "job_events": 3, "job_metrics": 8, "job_checkpoints": 1, "job_exports": 1}
    if engine.dialect.name == "sqlite":  # the migration turned foreign keys off for itself only
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()

    env = start_env(database_url=database_url, reconcile=False)
    done = env.job("old-done")
    assert (done["state"], done["name"], done["attempt"], done["iteration"]) == ("succeeded", "done", 1, 8)
    assert done["spec"]["training"]["train_iters"] == 8
    queued = env.job("old-queued")
    assert (queued["state"], queued["priority"]) == ("queued", 7)
    with env.client() as c:
        events = c.get("/v1/jobs/old-done/events").json()["events"]
        assert [e["kind"] for e in events] == ["submitted", "launch", "finished"]
        metrics = c.get("/v1/jobs/old-done/metrics").json()
        assert [m["iteration"] for m in metrics["records"]] == list(range(1, 9))
        checkpoints = c.get("/v1/jobs/old-done/checkpoints").json()
        assert checkpoints["checkpoints"][0]["iteration"] == 8
        # and the migrated store takes new work
        assert c.post("/v1/jobs", json=spec("new")).status_code == 201
    with env.client("bob") as c:
        assert c.get("/v1/jobs/old-done").status_code == 404  # still alice's
