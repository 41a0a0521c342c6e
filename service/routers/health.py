"""/healthz (the process answers), /readyz (the store answers), /metrics (Prometheus).

Readiness is the store's alone: every route but a job's logs works from the store (a submission
or a cancel is recorded and the reconciler acts on Ray when it can), so a Ray outage must not
take the API out of its Kubernetes Service. /readyz then says `degraded` (200), and the one
route that needs Ray answers 503 itself. Neither names an error's text or an internal address:
/readyz is anonymous, so what went wrong goes to the log.

/metrics lists every tenant's job ids: by default it needs the scrape token
(ELASTRON_METRICS_TOKEN, compared in constant time) or an admin token.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from service.auth import INVALID, MISSING, unauthorized
from service.context import AppContext
from service.deps import Credentials, Ctx, get_ctx

log = logging.getLogger("service")

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Always 200 while the process serves requests, whatever the state of the store or Ray."""
    return {"status": "ok"}


def _store_ok(ctx: AppContext) -> None:
    with ctx.engine.connect() as conn:
        conn.execute(text("SELECT 1"))


async def _ray_ok(ctx: AppContext) -> bool:
    reconciler = ctx.reconciler
    checked_at = reconciler.ray_checked_at  # the reconciler's own check, if recent: no extra Ray call
    if checked_at is not None and reconciler.clock() - checked_at < 3 * ctx.settings.reconcile_interval_s:
        return bool(reconciler.ray_reachable)
    try:
        return await asyncio.wait_for(
            asyncio.to_thread(ctx.launcher.reachable), timeout=ctx.settings.ray_timeout_s
        )
    except Exception as err:  # unreachable, whatever the reason; the reason goes to the log
        log.warning("readyz: %s did not answer: %s: %s", ctx.launcher.describe(), type(err).__name__, err)
        return False


@router.get(
    "/readyz",
    responses={
        200: {"description": "The store answers; `status` is `degraded` while Ray does not."},
        503: {"description": "The store is unreachable (the reason is in the API's log)."},
    },
)
async def readyz(ctx: Ctx) -> JSONResponse:
    """200 while the store answers (`status`: ok, or degraded while Ray is unreachable: only a
    job's logs need Ray); 503 when it does not. No error text: that is in the API's log."""
    try:
        await asyncio.wait_for(asyncio.to_thread(_store_ok, ctx), timeout=ctx.settings.ray_timeout_s)
        store_ok = True
    except Exception as err:  # any failure means not ready; the reason goes to the log only
        log.warning("readyz: the store is unreachable: %s: %s", type(err).__name__, err)
        store_ok = False
    ray_ok = await _ray_ok(ctx)
    body = {
        "ready": store_ok,
        "status": "unavailable" if not store_ok else "ok" if ray_ok else "degraded",
        "store": "ok" if store_ok else "unreachable",
        "ray": "ok" if ray_ok else "unreachable",
    }
    return JSONResponse(status_code=200 if store_ok else 503, content=body)


def _metrics_auth(request: Request, credentials: Credentials) -> None:
    ctx: AppContext = get_ctx(request)
    if not ctx.settings.metrics_require_token:
        return
    if credentials is None:
        raise unauthorized(MISSING)
    scrape = ctx.settings.metrics_token
    if scrape is not None and hmac.compare_digest(
        credentials.credentials.encode(), scrape.get_secret_value().encode()
    ):
        return
    principal = ctx.tokens.lookup(credentials.credentials)
    if principal is None:
        raise unauthorized(INVALID)
    if not principal.admin:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            detail="/metrics needs the scrape token (ELASTRON_METRICS_TOKEN) or an admin token",
        )


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format."}},
)
def metrics(ctx: Ctx, _auth: Annotated[None, Depends(_metrics_auth)]) -> Response:
    """The series of service/METRICS.md and the API's request metrics."""
    body = ctx.job_series.render().encode() + generate_latest(ctx.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
