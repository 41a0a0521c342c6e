"""Connections to the store: SQLite (a file, the local default) or Postgres, by URL.

SQLite is tuned for an API with a few writer threads: WAL (readers do not wait for the writer),
a busy timeout (writers wait for each other instead of failing), foreign keys on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError

T = TypeVar("T")


def make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, future=True)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def _retryable(err: Exception) -> bool:
    if isinstance(err, StaleDataError | IntegrityError):
        return True
    return isinstance(err, OperationalError) and "locked" in str(err).lower()


def in_transaction(sessions: sessionmaker[Session], fn: Callable[[Session], T], attempts: int = 8) -> T:
    """Run `fn` in one transaction; on a lost race (stale version, unique key taken by a concurrent
    writer, SQLite busy) run it again from a fresh read. `fn` must only touch the session."""
    for attempt in range(attempts):
        try:
            with sessions() as session, session.begin():
                return fn(session)
        except (StaleDataError, IntegrityError, OperationalError) as err:
            if attempt == attempts - 1 or not _retryable(err):
                raise
            time.sleep(0.005 * (2**attempt))
    raise AssertionError("unreachable")
