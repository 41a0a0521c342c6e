"""The store on SQLite and on a real (throwaway) Postgres: migrations, transitions, concurrent
writers, and the API's job flow on Postgres."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from service.states import JobState
from service.store import migrate
from service.store.db import in_transaction, make_engine, make_sessionmaker
from service.store.jobs import create_job, get_job, transition
from service.store.models import Base
from service.store.telemetry import ingest
from tests.service.test_api_jobs import TINY
from tests.service.test_attack_surfaces import scrape


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("fresh_pg_db")


def _spec(name="tiny", iters=10):
    return {"name": name, "training": {"train_iters": iters}}


def test_head_constant_matches_the_migrations():
    config = Config()
    config.set_main_option("script_location", str(migrate.MIGRATIONS))
    assert ScriptDirectory.from_config(config).get_current_head() == migrate.HEAD


def test_migrations_build_exactly_the_models_schema(db_url):
    engine = make_engine(db_url)
    assert migrate.current_revision(engine) is None
    assert migrate.upgrade(engine) is True
    assert migrate.upgrade(engine) is False  # already current: no Alembic at all
    assert migrate.current_revision(engine) == migrate.HEAD
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diffs == []
    engine.dispose()


def test_transitions_are_recorded_and_illegal_ones_refused(db_url):
    engine = make_engine(db_url)
    migrate.upgrade(engine)
    sessions = make_sessionmaker(engine)
    in_transaction(
        sessions,
        lambda s: create_job(
            s, job_id="j-1", tenant="t", spec=_spec(), idempotency_key=None, request_hash=None
        ),
    )

    def move(to):
        return in_transaction(sessions, lambda s: transition(s, get_job(s, "j-1"), to, f"to {to}"))

    assert move(JobState.STARTING) and move(JobState.RUNNING) and move(JobState.SUCCEEDED)
    assert not move(JobState.RUNNING)  # a finished job stays finished
    with sessions() as s:
        job = get_job(s, "j-1")
        assert job.state == "succeeded" and job.finished_at is not None and job.started_at is not None
        assert job.stats["transitions"] == {"queued": 1, "starting": 1, "running": 1, "succeeded": 1}
        kinds = [e.kind for e in s.query(Base.metadata.tables["job_events"]).all()]
    assert kinds.count("state") == 4 and kinds.count("transition_ignored") == 1
    engine.dispose()


def test_concurrent_writers_lose_no_update(db_url):
    """Telemetry threads and the reconciler write the same job row: the version column makes a
    stale write fail and retry instead of overwriting (every record and counter survives)."""
    engine = make_engine(db_url)
    migrate.upgrade(engine)
    sessions = make_sessionmaker(engine)
    in_transaction(
        sessions,
        lambda s: create_job(
            s, job_id="j-2", tenant="t", spec=_spec(iters=400), idempotency_key=None, request_hash=None
        ),
    )
    errors = []

    def writer(start: int) -> None:
        try:
            for i in range(start, start + 25):
                in_transaction(
                    sessions,
                    lambda s, i=i: ingest(
                        s, get_job(s, "j-2"), [{"iteration": i, "tokens": 10, "step_time_s": 0.1}], []
                    ),
                    attempts=50,
                )
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(k * 100,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with sessions() as s:
        job = get_job(s, "j-2")
        assert job.stats["tokens"] == 1000 and job.stats["step"]["count"] == 100
        assert job.state == "running" and job.stats["transitions"]["running"] == 1
    engine.dispose()


def test_the_api_on_postgres(start_env, fresh_pg_db):
    env = start_env(database_url=fresh_pg_db)
    with env.client() as c:
        first = c.post("/v1/jobs", json=TINY, headers={"Idempotency-Key": "pg"}).json()
        assert c.post("/v1/jobs", json=TINY, headers={"Idempotency-Key": "pg"}).json()["id"] == first["id"]
        env.wait_state(first["id"], "starting")
    with env.client(token=env.launcher.env_of(first["id"])["ELASTRON_API_TOKEN"]) as worker:
        body = {
            "records": [{"iteration": 1, "loss": float("nan"), "tokens": 5}, {"iteration": 2, "loss": 2.0}],
            "events": [{"kind": "checkpoint_saved", "iteration": 2, "uri": "/c", "bytes": 3, "ts": 1.0}],
        }
        import json

        r = worker.post(
            f"/v1/internal/jobs/{first['id']}/telemetry",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 200, r.text
    job = env.job(first["id"])
    assert job["state"] == "running" and job["iteration"] == 2 and job["latest_checkpoint"]["uri"] == "/c"
    with env.client() as c:
        assert c.get(f"/v1/jobs/{first['id']}/metrics").json()["records"][0]["loss"] is None
        assert f'elastron_job_iteration{{job="{first["id"]}",tenant="alice"}} 2.0' in scrape(env)
        assert [j["id"] for j in c.get("/v1/jobs", params={"state": "running"}).json()["jobs"]] == [
            first["id"]
        ]
