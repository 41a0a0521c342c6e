"""/v1/jobs/{job_id}/logs: the job's driver log, from Ray (the one job route that needs Ray).

Ray calls run off the event loop with a deadline; an unreachable or slow Ray is a 503 with
Retry-After, never a hung request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response, status
from fastapi.responses import PlainTextResponse, StreamingResponse

from service.deps import Caller, Ctx, JobId, not_found
from service.launcher import LauncherUnavailable
from service.routers.jobs import AUTH, NOT_FOUND
from service.schemas import Problem
from service.states import FINAL
from service.store.jobs import get_job
from service.store.tokens import Principal

log = logging.getLogger("service")

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_UNAVAILABLE = {503: {"model": Problem, "description": "Ray is unreachable or slow; retry later."}}
_FOLLOW_RETRIES, _FOLLOW_RETRY_S = 10, 2.0


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={
        **AUTH,
        **NOT_FOUND,
        **_UNAVAILABLE,
        429: {"model": Problem, "description": "Logs read too often (see Retry-After)."},
        200: {"content": {"text/plain": {}}, "description": "The driver's log (Ray)."},
    },
)
async def job_logs(
    job_id: JobId,
    ctx: Ctx,
    caller: Caller,
    follow: Annotated[
        bool, Query(description="Keep the response open and stream new lines until the job ends.")
    ] = False,
) -> Response:
    """The job's log from Ray (empty before it is launched); with follow, a stream. Each read or
    stream spends from the tenant's ELASTRON_LOG_RATE_PER_MINUTE (each is a call on Ray)."""
    submission_id = await asyncio.to_thread(_visible_submission, ctx, caller, job_id)
    await asyncio.to_thread(ctx.limits.enforce, caller.tenant, "logs", "reads logs")
    if not follow:
        if submission_id is None:
            return PlainTextResponse("")
        try:
            text = await asyncio.wait_for(
                asyncio.to_thread(ctx.launcher.logs, submission_id), timeout=2 * ctx.settings.ray_timeout_s
            )
        except (LauncherUnavailable, TimeoutError) as err:
            raise _ray_unavailable(ctx, err) from None
        return PlainTextResponse(text)
    try:
        reachable = await asyncio.wait_for(
            asyncio.to_thread(ctx.launcher.reachable), timeout=2 * ctx.settings.ray_timeout_s
        )
    except TimeoutError:
        reachable = False
    if not reachable:
        raise _ray_unavailable(ctx, None)
    return StreamingResponse(_follow(ctx, job_id), media_type="text/plain; charset=utf-8")


def _visible_submission(ctx: Ctx, caller: Principal, job_id: str) -> str | None:
    with ctx.sessions() as session:  # a short session: a followed log may stay open for hours
        job = get_job(session, job_id)
        if job is None or not caller.can_see(job.tenant):
            raise not_found(job_id)
        return job.submission_id


def _launch_state(ctx: Ctx, job_id: str) -> tuple[str | None, bool]:
    with ctx.sessions() as session:
        job = get_job(session, job_id)
        return (job.submission_id, job.state in FINAL) if job else (None, True)


async def _follow(ctx: Ctx, job_id: str) -> AsyncIterator[str]:
    """Wait for the launch, then stream Ray's log until the job ends; a relaunch (a new
    submission) is followed too. A broken stream is reopened (Ray answers 404 until the job's
    driver has started), skipping what was already sent, and given up after a few tries."""
    sent: dict[str, int] = {}  # characters of each submission's log already sent
    finished: set[str] = set()
    failures = 0
    while True:
        sid, final = await asyncio.to_thread(_launch_state, ctx, job_id)
        if sid is not None and sid not in finished:
            seen = 0  # characters of this connection's stream so far
            try:
                async for chunk in ctx.launcher.tail(sid):
                    new = chunk[max(0, sent.get(sid, 0) - seen) :]
                    seen += len(chunk)
                    if new:
                        sent[sid] = sent.get(sid, 0) + len(new)
                        yield new
                finished.add(sid)
                continue
            except LauncherUnavailable as err:
                failures += 1
                if failures >= _FOLLOW_RETRIES:
                    log.warning("logs of %s: the stream from Ray broke %d times: %s", job_id, failures, err)
                    yield "\n[elastron] log stream interrupted: Ray is unreachable; follow the log again later\n"
                    return
                await asyncio.sleep(_FOLLOW_RETRY_S)
                continue
        if final:
            return
        await asyncio.sleep(1.0)


def _ray_unavailable(ctx: Ctx, err: Exception | None) -> HTTPException:
    # Ray's address and its errors are the cluster's internals: the log has them, the tenant not.
    log.warning("logs: %s is unreachable or slow: %s", ctx.launcher.describe(), err or "not reachable")
    return HTTPException(
        status.HTTP_503_SERVICE_UNAVAILABLE,
        detail="cannot read logs now: Ray is unreachable or slow; retry later",
        headers={"Retry-After": "5"},
    )
