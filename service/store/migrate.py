"""Bring the store's schema to the newest revision shipped in this package (run at API start).

The check costs one query and no Alembic import when the store is already current (the usual
start): `HEAD` names the newest revision, and a test keeps it equal to what Alembic computes
from service/store/migrations/versions. On Postgres an advisory lock makes concurrent starts
(several API replicas) upgrade one after the other instead of racing on CREATE TABLE.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Connection, Engine, inspect, text

HEAD = "0009_evals"
MIGRATIONS = Path(__file__).parent / "migrations"
_PG_LOCK_ID = 0x656C617374726F6E  # "elastron"


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def upgrade(engine: Engine) -> bool:
    """Apply pending migrations; returns whether any ran."""
    if current_revision(engine) == HEAD:
        return False
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            _sqlite_foreign_keys(conn, on=False)
        try:
            with conn.begin():
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _PG_LOCK_ID})
                config.attributes["connection"] = conn
                command.upgrade(config, "head")
                if sqlite:
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise RuntimeError(f"migrating the store left rows without their parent: {broken[:5]}")
        finally:
            if sqlite:
                _sqlite_foreign_keys(conn, on=True)
    return True


def _sqlite_foreign_keys(conn: Connection, *, on: bool) -> None:
    """SQLite changes most of a table by rebuilding it (Alembic's batch mode: copy, DROP, rename).
    With foreign keys on, dropping `jobs` deletes every job's events, metrics, checkpoints and
    exports (ON DELETE CASCADE), so migrations run with them off, as SQLite's own procedure for a
    rebuild says, and `PRAGMA foreign_key_check` proves nothing was left dangling. The pragma is
    ignored inside a transaction: it is set between transactions."""
    conn.exec_driver_sql(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")
    conn.commit()
