"""Bearer-token authentication: a token names a principal (a study owner, or the admin).

A principal's *scope* is what its search plans are shared within: its own name, or the team it belongs
to (``MasterSettings.auth.teams``). Studies stay visible only to their owner; plans (the stored metrics
and checkpoints) are shared only within a scope.

The API adapters extract the token (gRPC metadata ``authorization: Bearer ...``, the HTTP
``Authorization`` header) and the use-case layer asks ``Authenticator`` who it is. Tokens come from
``MasterSettings.auth`` and are compared in constant time.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from stagetree.core.errors import InvalidArgument, PermissionDenied, Unauthenticated
from stagetree.master.settings import AuthSettings

ADMIN = "__admin__"


@dataclass(frozen=True)
class Principal:
    name: str
    admin: bool = False
    team: str = ""

    @property
    def scope(self) -> str:
        """Whose plans this principal's studies share: its team's, or its own."""
        return scope_of(self.name, self.team)

    def require_admin(self) -> None:
        if not self.admin:
            raise PermissionDenied("this call needs the admin token (node managers and operators)")


def scope_of(owner: str, team: str = "") -> str:
    """The scope a plan of ``owner``'s studies is shared within (``FixedPart.key(scope)``)."""
    return f"team:{team}" if team else f"owner:{owner}"


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
        self._team_of = team_of(settings)

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
        return Principal(found, team=self._team_of.get(found, ""))


def team_of(settings: AuthSettings) -> dict[str, str]:
    """Owner name -> its team; an owner in two teams would make its plans' scope ambiguous."""
    out: dict[str, str] = {}
    for team, members in settings.teams.items():
        if not team or ":" in team:
            raise InvalidArgument(f"auth.teams: team name {team!r} must be non-empty and without ':'")
        for owner in members:
            if owner in out and out[owner] != team:
                raise InvalidArgument(
                    f"auth.teams: owner {owner!r} is in teams {out[owner]!r} and {team!r}; an owner has one team"
                )
            out[owner] = team
    return out
