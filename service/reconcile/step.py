"""What every step of the reconcile loop works with: the store's sessions, the launcher, the
settings, the loop's clock (a test's clock in tests) and the loop's stop flag (a step checks it
between jobs, so a stopping API does not wait out a long pass). One base class so that the steps
are built alike and a new one gets the same five things."""

from __future__ import annotations

import threading
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from service.launcher import Launcher
from service.settings import Settings


class ReconcileStep:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        launcher: Launcher,
        settings: Settings,
        clock: Callable[[], float],
        stopping: threading.Event,
    ):
        self.sessions, self.launcher, self.settings, self.clock = sessions, launcher, settings, clock
        self._stopping = stopping
