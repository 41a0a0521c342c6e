"""One scheduler at a time. Several API replicas may share a store (Postgres); each runs a
reconciler, and two scheduling passes deciding on the same free room would admit more than the
cluster holds. So only the replica holding the scheduler lease schedules; the others still watch
their launches and apply statuses, and take over when the holder goes away.

On Postgres the lease is a session-level advisory lock held on a connection of its own (in
autocommit, so no transaction stays open): the lock goes when the holder's connection does,
whether it stopped or crashed. SQLite is one machine's file served by one API: always held.
"""

from __future__ import annotations

import logging

from sqlalchemy import Connection, Engine, text

log = logging.getLogger(__name__)

_LOCK_ID = 0x656C617374726F73  # "elastros": distinct from the migrations' lock


class SchedulerLease:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._conn: Connection | None = None

    def held(self) -> bool:
        """Whether this process may schedule now (taking the lease when it is free)."""
        if self.engine.dialect.name != "postgresql":
            return True
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1"))
                return True
            except Exception as err:  # the connection broke: the lock went with it
                log.warning("scheduler lease lost: %s", err)
                self.release()
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            got = conn.execute(text("SELECT pg_try_advisory_lock(:id)"), {"id": _LOCK_ID}).scalar()
        except Exception:
            conn.close()
            raise
        if got:
            log.info("this API process holds the scheduler lease")
            self._conn = conn
            return True
        conn.close()
        return False

    def release(self) -> None:
        """Give the lease up: the connection is closed for good, not returned to the pool (a
        pooled connection would keep the session's lock)."""
        if self._conn is not None:
            try:  # unlocked now: the server ends a closed session's locks only when its backend exits
                self._conn.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": _LOCK_ID})
            except Exception:  # a broken connection: its lock is gone with it
                pass
            try:
                self._conn.invalidate()
                self._conn.close()
            except Exception:  # closing a broken connection: nothing more to do
                pass
            self._conn = None
