"""The master's admission limit: how many client calls may be in flight at once, shared by REST and gRPC.

Past the limit a call is refused at once, before anything of it is read or done, with a hint of when to
come back: HTTP 429 with a ``Retry-After`` header (whole seconds) and ``retry_after_s`` in the body; gRPC
``RESOURCE_EXHAUSTED`` with ``retry-after-ms`` in the trailing metadata. Refusing is what keeps memory
bounded under overload: an admitted call holds a worker thread and a database connection, a refused one
holds nothing, where an unbounded queue would grow with the offered load. Since a refused call did
nothing, the SDK retries any call so refused (``stagetree.client.sdk``), idempotent or not.

The node managers' calls (heartbeats, registration, reports, assignment streams) are never shed: they
are what turns admitted work into results.
"""

from __future__ import annotations

import json
import math
import threading

from stagetree.master.api.guard import ASGIApp, Receive, Scope, Send

RETRY_AFTER_MD = "retry-after-ms"  # the gRPC trailing metadata key the SDK reads


class Admission:
    """A counter of calls in flight against ``limit``; ``refused`` counts the calls shed so far and
    ``peak`` the most in flight at once."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.refused = 0
        self.peak = 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self.in_flight >= self.limit:
                self.refused += 1
                return False
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            return True

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def message(self) -> str:
        return (
            f"the master is at its limit of {self.limit} calls in flight "
            "(STAGETREE_MASTER_LIMITS__MAX_IN_FLIGHT); nothing was done: retry after "
            f"{self.retry_after_s:g} s"
        )


# REST paths that are never shed: health is how an operator sees an overloaded master is alive
_EXEMPT_SUFFIXES = ("/health", "/metrics", "/openapi.json", "/docs")


class AdmissionGuard:
    """The REST side of :class:`Admission` (an ASGI middleware, outermost: a shed call reads nothing)."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or str(scope.get("path", "")).endswith(_EXEMPT_SUFFIXES):
            await self.app(scope, receive, send)
            return
        if not self.admission.try_enter():
            await self._refuse(send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave()

    async def _refuse(self, send: Send) -> None:
        a = self.admission
        body = json.dumps(
            {"error": "RESOURCE_EXHAUSTED", "message": a.message(), "retry_after_s": a.retry_after_s}
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(max(1, math.ceil(a.retry_after_s))).encode()),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})
