"""Request limits: a body-size cap for every route and per-tenant request rates.

The size cap is ASGI middleware that counts bytes as they arrive, so a client that lies in
Content-Length, or sends a chunked body, still cannot make the API buffer more than the cap.

The rates (submissions, exports, YAML parses, log reads) are token buckets kept in the store
(table request_limits), not in the process: with several API replicas behind one Service, a
bucket per process let each replica grant the whole burst (issue 61). A request spends one
token with a single conditional UPDATE that refills and spends at once, so it is atomic on
SQLite and Postgres alike (Postgres re-checks the condition on the row a concurrent request just
updated), and the bucket's refill uses the wall clock every replica shares.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException as ApiError
from fastapi import status
from sqlalchemy import case, insert, literal, select, update
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.store.db import in_transaction
from service.store.models import RequestLimit


class BodyTooLarge(HTTPException):
    """Raised from `receive` when the body passes the cap: an HTTPException, so the route's body
    parsing lets it through as a 413 instead of turning it into a 400."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body larger than {max_bytes} bytes (ELASTRON_MAX_BODY_BYTES)")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        await send_problem(
            send, 413, f"request body larger than {self.max_bytes} bytes (ELASTRON_MAX_BODY_BYTES)"
        )


async def send_problem(send: Send, status: int, detail: str) -> None:
    """A whole JSON `{"detail": ...}` response sent from middleware, where no route answers."""
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True)
class Rate:
    """`burst` requests at once, then `per_minute` spread over the minute; `setting` names the
    ELASTRON_* variable in the 429's message."""

    per_minute: float
    burst: int
    setting: str


class StoreRateLimiter:
    """Token buckets per (tenant, kind) in the store, shared by every API replica."""

    def __init__(
        self, sessions: sessionmaker[Session], rates: dict[str, Rate], clock: Callable[[], float] = time.time
    ):
        self.sessions, self.rates, self.clock = sessions, rates, clock

    def take(self, tenant: str, kind: str) -> float:
        """0 when allowed (one token spent), else the seconds until a token is there."""
        rate = self.rates[kind]
        per_s, burst = rate.per_minute / 60.0, float(rate.burst)
        return in_transaction(self.sessions, lambda s: self._take(s, tenant, kind, per_s, burst))

    def _take(self, session: Session, tenant: str, kind: str, per_s: float, burst: float) -> float:
        now = self.clock()
        row = (RequestLimit.tenant == tenant) & (RequestLimit.kind == kind)
        elapsed = case((RequestLimit.updated_at < now, literal(now) - RequestLimit.updated_at), else_=0.0)
        refilled = RequestLimit.tokens + elapsed * per_s
        available = case((refilled > burst, literal(burst)), else_=refilled)
        tokens = 0.0
        for _ in range(5):
            spent = session.execute(
                update(RequestLimit)
                .where(row, available >= 1.0)
                .values(tokens=available - 1.0, updated_at=now)
                .execution_options(synchronize_session=False)
            ).rowcount
            if spent:
                return 0.0
            tokens = session.scalar(select(available).where(row))
            if tokens is None:
                # The tenant's first request of this kind: a full bucket, less this one. A
                # concurrent first request that inserted it first makes this an IntegrityError,
                # and in_transaction runs the whole take again (then spending from that row).
                session.execute(
                    insert(RequestLimit).values(tenant=tenant, kind=kind, tokens=burst - 1.0, updated_at=now)
                )
                return 0.0
            if tokens < 1.0:
                break
            # A token is there after all: the row was inserted by a concurrent first request
            # between the UPDATE and the SELECT (Postgres). Spend again.
        return max(0.1, math.ceil((1.0 - tokens) / per_s * 10) / 10)

    def enforce(self, tenant: str, kind: str, what: str) -> None:
        """Spend one token of `kind` or raise the 429 (with Retry-After) naming the setting."""
        wait = self.take(tenant, kind)
        if wait:
            raise ApiError(
                status.HTTP_429_TOO_MANY_REQUESTS,
                detail=f"tenant {tenant!r} {what} faster than {self.rates[kind].setting} allows; "
                f"retry in {wait:g} s",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )


def request_rates(settings) -> dict[str, Rate]:
    """The rates of service/settings.py, by the kind of request they limit."""
    return {
        "submit": Rate(
            settings.submit_rate_per_minute, settings.submit_burst, "ELASTRON_SUBMIT_RATE_PER_MINUTE"
        ),
        "export": Rate(
            settings.export_rate_per_minute, settings.export_burst, "ELASTRON_EXPORT_RATE_PER_MINUTE"
        ),
        "parse": Rate(settings.parse_rate_per_minute, settings.parse_burst, "ELASTRON_PARSE_RATE_PER_MINUTE"),
        "logs": Rate(settings.log_rate_per_minute, settings.log_burst, "ELASTRON_LOG_RATE_PER_MINUTE"),
    }


class ResponseSizeLimit:
    """Refuse to send a response whose declared size passes the cap (ELASTRON_MAX_RESPONSE_BYTES).

    Every list route has a `limit` and the YAML parse an alias budget, so a response is bounded
    where it is built; this is the backstop for what those bounds miss (records full of per-rank
    arrays, a huge driver log read whole): the client gets a small 400 naming the setting instead
    of the bytes. A streamed response (a followed log) declares no size and is not cut: it is the
    job's own log, and each stream spends from the tenant's log rate. /metrics is the operator's
    (behind its token) and grows with the number of jobs: not capped either.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, exempt: tuple[str, ...] = ("/metrics",)):
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        refused = False

        async def checking_send(message: Message) -> None:
            nonlocal refused
            if refused:
                return  # the refusal is sent; drop the body that would have followed
            if message["type"] == "http.response.start":
                declared = dict(message.get("headers") or []).get(b"content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    refused = True
                    await self._refuse(send, int(declared))
                    return
            await send(message)

        await self.app(scope, receive, checking_send)

    async def _refuse(self, send: Send, size: int) -> None:
        await send_problem(
            send,
            400,
            f"the response would be {size} bytes, more than ELASTRON_MAX_RESPONSE_BYTES "
            f"({self.max_bytes}): ask for less (a smaller limit=, a narrower filter)",
        )
