"""Bearer-token authentication for the API.

Every /v1 route needs a token; there is no anonymous mode to forget to turn off. A wrong or
missing token is 401. A valid token never learns about other tenants' jobs: those are 404,
exactly like jobs that do not exist (service/deps.py `visible_job`).

Valid tokens are cached for a few seconds (a request should not cost a token query), so a
revoked token stops working within `ttl_s`; unknown tokens are never cached, so a token made a
moment ago works at once.
"""

from __future__ import annotations

import threading
import time

from fastapi import HTTPException, status
from fastapi.security import HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from service.store.tokens import Principal, find_principal

bearer = HTTPBearer(
    auto_error=False,
    description="A token from `elastron token create --tenant NAME` (or the file `elastron up` prints).",
)

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail=detail, headers=_CHALLENGE)


MISSING = (
    "missing bearer token: send 'Authorization: Bearer <token>' (create one with `elastron token create`)"
)
INVALID = "invalid or revoked token"


class TokenCache:
    def __init__(self, sessions: sessionmaker[Session], ttl_s: float = 10.0):
        self.sessions, self.ttl_s = sessions, ttl_s
        self._cache: dict[str, tuple[Principal, float]] = {}
        self._lock = threading.Lock()

    def lookup(self, secret: str) -> Principal | None:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(secret)
        if hit is not None and hit[1] > now:
            return hit[0]
        with self.sessions() as session:
            principal = find_principal(session, secret)
        if principal is not None:
            with self._lock:
                if len(self._cache) > 10_000:
                    self._cache.clear()
                self._cache[secret] = (principal, now + self.ttl_s)
        return principal
