"""The REST boundary's first check, before any route parses a body (an ASGI middleware).

- A body over ``max_bytes`` is refused with 413 before it is read in full (by its ``Content-Length``,
  or while it streams in).
- A JSON body is refused with 422 when it nests deeper than ``core.text.MAX_JSON_DEPTH`` (counted before
  any parser recurses into it), holds ``NaN``/``Infinity`` (not JSON numbers, though Python's parser takes
  them) or a string with a lone surrogate (which no database stores): each would otherwise reach a route,
  and the error answer itself could not be serialized. So is a body that is not UTF-8 (FastAPI would
  answer a 400 of its own shape).

Everything else goes through untouched: malformed JSON is FastAPI's own 422.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from stagetree.core.text import MAX_JSON_DEPTH, json_depth

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_WITH_BODY = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class _NotANumber(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _NotANumber(name)


def body_problem(body: bytes) -> str | None:
    """Why a JSON body is refused at the boundary, or None (also None for malformed JSON)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"the body is not UTF-8 text (byte {e.start}); send JSON encoded as UTF-8"
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        return f"the body nests JSON {depth} levels deep, over the limit of {MAX_JSON_DEPTH}; send a flatter document"
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except _NotANumber as e:
        return f"{e} is not a JSON number; send finite numbers only"
    except ValueError:
        return None  # malformed: the route's own parser answers it
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "a string holds a lone surrogate (an invalid \\ud800-\\udfff escape); send valid Unicode text"
    return None


class BodyGuard:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await _answer(send, 413, "RESOURCE_EXHAUSTED", self._too_big(int(length)))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _answer(send, 413, "RESOURCE_EXHAUSTED", self._too_big(size))
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and b"json" in headers.get(b"content-type", b"application/json"):
            problem = body_problem(body)
            if problem is not None:
                await _answer(send, 422, "INVALID_ARGUMENT", problem)
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_big(self, size: int) -> str:
        return (
            f"the request body ({size} bytes so far) is over the limit of {self.max_bytes} bytes "
            "(STAGETREE_MASTER_LIMITS__MAX_BODY_BYTES); split it"
        )


async def _answer(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": code, "message": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
