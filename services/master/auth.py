"""Bearer-token authentication: a token names a principal (a study owner, or the admin).

The API adapters extract the token (gRPC metadata ``authorization: Bearer ...``, the HTTP
``Authorization`` header) and the use-case layer asks ``Authenticator`` who it is. Tokens come from
``MasterSettings.auth`` and are compared in constant time.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from stagetree.core.errors import PermissionDenied, Unauthenticated
from stagetree.master.settings import AuthSettings

ADMIN = "__admin__"


@dataclass(frozen=True)
class Principal:
    name: str
    admin: bool = False

    def require_admin(self) -> None:
        if not self.admin:
            raise PermissionDenied("this call needs the admin token (node managers and operators)")


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization`` value, or None when there is none."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Authenticator:
    def __init__(self, settings: AuthSettings) -> None:
        self._tokens = [(name, tok.get_secret_value().encode()) for name, tok in settings.tokens.items()]
        admin = settings.admin_token.get_secret_value()
        self._admin = admin.encode() if admin else None

    def authenticate(self, token: str | None) -> Principal:
        if not token:
            raise Unauthenticated("no bearer token; send 'authorization: Bearer <token>'")
        given = token.encode()
        if self._admin is not None and hmac.compare_digest(given, self._admin):
            return Principal(ADMIN, admin=True)
        found = None
        for name, tok in self._tokens:  # no early exit: the time does not depend on which token matched
            if hmac.compare_digest(given, tok):
                found = name
        if found is None:
            raise Unauthenticated("unknown bearer token; check STAGETREE_MASTER_AUTH__TOKENS")
        return Principal(found)
