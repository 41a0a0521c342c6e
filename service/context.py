"""What one API instance holds: settings, the store, the launcher, the reconciler, limits, metrics.

Kept on `app.state.ctx` and handed to routes by `service.deps.get_ctx`, so two apps in one
process (tests restart the API in-process) share nothing but the database.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.auth import TokenCache
from service.launcher import Launcher
from service.limits import StoreRateLimiter
from service.metrics import JobSeries
from service.reconciler import Reconciler
from service.settings import Settings


@dataclass
class AppContext:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    launcher: Launcher
    reconciler: Reconciler
    tokens: TokenCache
    limits: StoreRateLimiter  # per-tenant request rates, in the store (shared by replicas)
    registry: CollectorRegistry  # the API's request metrics
    job_series: JobSeries  # the job series of METRICS.md
