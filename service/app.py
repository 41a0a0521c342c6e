"""The FastAPI application: `uvicorn --factory service.app:create_app` serves it.

`create_app(settings, launcher=...)` builds one instance: settings default to the `ELASTRON_*`
environment, the launcher to Ray Jobs at ELASTRON_RAY_ADDRESS (tests pass their own). At start
the store's migrations are applied and the reconciler starts in the background; nothing at
start talks to Ray, so the API answers /healthz with Ray down.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, disable_created_metrics

from service import errors
from service.auth import TokenCache
from service.context import AppContext
from service.launcher import EntrypointResources, Launcher, RayJobsLauncher
from service.limits import BodySizeLimit, ResponseSizeLimit, StoreRateLimiter, request_rates
from service.metrics import HttpMetrics, JobSeries, SchedulerMetrics
from service.reconciler import Reconciler
from service.routers import evals, exports, health, jobs, logs, scheduling, storage, sweeps, telemetry, ui
from service.settings import Settings
from service.store.db import make_engine, make_sessionmaker
from service.store.migrate import upgrade
from service.surface_headers import SecurityHeaders

log = logging.getLogger("service")

DESCRIPTION = """Submit training jobs (the job file of `elastron train`, as JSON), follow them, cancel them.

Every `/v1` call needs `Authorization: Bearer <token>` (`elastron token create --tenant NAME`).
Jobs belong to the token's tenant; other tenants' jobs are 404. Metric names: service/METRICS.md.
"""


def create_app(
    settings: Settings | None = None, *, launcher: Launcher | None = None, reconcile: bool = True
) -> FastAPI:
    """Build the API. `reconcile=False` leaves jobs untouched (tests of the HTTP surface alone)."""
    settings = settings or Settings()
    engine = make_engine(settings.resolved_database_url)
    sessions = make_sessionmaker(engine)
    if launcher is None:
        # Ray 2.60 clusters use token auth by default and Ray Job clients need
        # RAY_AUTH_MODE=token to send the token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
        # ~/.ray/auth_token). Ray reads the mode once per process, so the API process sets it
        # before its first Ray call; an explicit RAY_AUTH_MODE (e.g. disabled) is respected.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        launcher = RayJobsLauncher(
            settings.ray_address,
            entrypoint=settings.worker_entrypoint,
            timeout_s=settings.ray_timeout_s,
            driver_resources=EntrypointResources(num_cpus=settings.driver_num_cpus),
        )
    disable_created_metrics()  # METRICS.md names exactly what is exposed: no *_created series
    registry = CollectorRegistry(auto_describe=False)
    ctx = AppContext(
        settings=settings,
        engine=engine,
        sessions=sessions,
        launcher=launcher,
        reconciler=Reconciler(sessions, launcher, settings, metrics=SchedulerMetrics(registry)),
        tokens=TokenCache(sessions),
        limits=StoreRateLimiter(sessions, request_rates(settings)),
        registry=registry,
        job_series=JobSeries(sessions, settings.metrics_retention_s),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if upgrade(engine):
            log.info(
                "store migrated to the newest schema (%s)", engine.url.render_as_string(hide_password=True)
            )
        task = asyncio.create_task(ctx.reconciler.run()) if reconcile else None
        try:
            yield
        finally:
            if task is not None:
                ctx.reconciler.stop()
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
            engine.dispose()

    app = FastAPI(
        title="elastron",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url="/docs",
        openapi_url="/openapi.json",
    )
    app.state.ctx = ctx
    errors.install(app)
    app.include_router(jobs.router)
    app.include_router(exports.router)
    app.include_router(evals.router)
    app.include_router(sweeps.router)
    app.include_router(scheduling.router)
    app.include_router(storage.router)
    app.include_router(logs.router)
    app.include_router(telemetry.router)
    app.include_router(health.router)
    app.include_router(ui.router)
    app.mount("/ui/static", ui.static, name="ui-static")
    # Outermost first: request metrics see every response, the size cap runs before any route.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ResponseSizeLimit, max_bytes=settings.max_response_bytes)
    app.add_middleware(SecurityHeaders)
    app.add_middleware(HttpMetrics, registry=registry)
    return app
