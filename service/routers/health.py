"""/healthz (the process answers), /readyz (the store and Ray answer), /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from service.auth import INVALID, MISSING, unauthorized
from service.context import AppContext
from service.deps import Credentials, Ctx, get_ctx

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Always 200 while the process serves requests, whatever the state of the store or Ray."""
    return {"status": "ok"}


def _store_ok(ctx: AppContext) -> None:
    with ctx.engine.connect() as conn:
        conn.execute(text("SELECT 1"))


@router.get("/readyz", responses={503: {"description": "The store or Ray is unreachable."}})
async def readyz(ctx: Ctx) -> JSONResponse:
    """200 when the store and Ray both answer; 503 naming what does not."""
    checks: dict[str, str] = {}
    try:
        await asyncio.wait_for(asyncio.to_thread(_store_ok, ctx), timeout=ctx.settings.ray_timeout_s)
        checks["store"] = "ok"
    except Exception as err:  # any failure means not ready; say which
        checks["store"] = f"unreachable: {type(err).__name__}: {err}"
    reconciler = ctx.reconciler
    checked_at = reconciler.ray_checked_at  # the reconciler's own check, if recent: no extra Ray call
    if checked_at is not None and reconciler.clock() - checked_at < 3 * ctx.settings.reconcile_interval_s:
        ray_ok = bool(reconciler.ray_reachable)
    else:
        try:
            ray_ok = await asyncio.wait_for(
                asyncio.to_thread(ctx.launcher.reachable), timeout=ctx.settings.ray_timeout_s
            )
        except TimeoutError:
            ray_ok = False
    checks["ray"] = "ok" if ray_ok else f"unreachable: {ctx.launcher.describe()}"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse(status_code=200 if ready else 503, content={"ready": ready, **checks})


def _metrics_auth(request: Request, credentials: Credentials) -> None:
    ctx: AppContext = get_ctx(request)
    if not ctx.settings.metrics_require_token:
        return
    if credentials is None:
        raise unauthorized(MISSING)
    principal = ctx.tokens.lookup(credentials.credentials)
    if principal is None:
        raise unauthorized(INVALID)
    if not principal.admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="/metrics needs an admin token")


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format."}},
)
def metrics(ctx: Ctx, _auth: Annotated[None, Depends(_metrics_auth)]) -> Response:
    """The series of service/METRICS.md and the API's request metrics."""
    body = ctx.job_series.render().encode() + generate_latest(ctx.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
