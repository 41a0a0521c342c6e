"""Bearer tokens: made here, stored as sha256 only.

Two kinds. User tokens (`elt_...`) belong to a tenant, optionally admin, and are created with
`elastron token create`. Job tokens (`elj_...`) are minted per launch attempt and handed to that
job's workers; they can only post that job's telemetry (their hash sits on the job row).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.store.db import in_transaction
from service.store.models import Token

USER_PREFIX = "elt_"
JOB_PREFIX = "elj_"
TENANT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant (admins see every tenant's jobs)."""

    tenant: str
    admin: bool
    token_id: str

    def can_see(self, tenant: str) -> bool:
        return self.admin or self.tenant == tenant


def check_tenant_name(tenant: str) -> str:
    if not TENANT_PATTERN.match(tenant):
        raise ValueError(
            f"tenant {tenant!r} is not a valid name: use lowercase letters, digits, '.', '_' and '-' "
            "(up to 63 characters, starting with a letter or digit)"
        )
    return tenant


def create_token(sessions: sessionmaker[Session], tenant: str, admin: bool = False) -> tuple[Principal, str]:
    """Create a user token; returns the principal and the secret (shown once, never stored)."""
    check_tenant_name(tenant)
    secret = new_secret(USER_PREFIX)
    token_id = "tok_" + secrets.token_hex(6)

    def insert(session: Session) -> None:
        session.add(
            Token(
                id=token_id,
                tenant=tenant,
                admin=admin,
                secret_hash=hash_secret(secret),
                created_at=time.time(),
            )
        )

    in_transaction(sessions, insert)
    return Principal(tenant=tenant, admin=admin, token_id=token_id), secret


def revoke_token(sessions: sessionmaker[Session], token_id: str) -> bool:
    """Revoke a token by its id (tok_...); False when there is no such active token."""

    def revoke(session: Session) -> bool:
        token = session.get(Token, token_id)
        if token is None or token.revoked_at is not None:
            return False
        token.revoked_at = time.time()
        return True

    return in_transaction(sessions, revoke)


def list_tokens(sessions: sessionmaker[Session]) -> list[Token]:
    with sessions() as session:
        return list(session.scalars(select(Token).order_by(Token.created_at)))


def find_principal(session: Session, secret: str) -> Principal | None:
    if not secret.startswith(USER_PREFIX):
        return None
    token = session.scalar(select(Token).where(Token.secret_hash == hash_secret(secret)))
    if token is None or token.revoked_at is not None:
        return None
    return Principal(tenant=token.tenant, admin=token.admin, token_id=token.id)
