"""The one table between the core error tree and the wire: each error class's gRPC status code and HTTP
status, and back from a status code to the class.

The master's adapters (gRPC and REST) answer through :func:`status_of`; the SDK and the node-manager link
turn a status code back into the same class through :func:`error_class_of`. Whether a caller retries is
the class's ``retriable`` flag (``Unavailable``, ``Conflict``) and nothing else: a master bug
(``INTERNAL``/``UNKNOWN``) is not retried.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from stagetree.core import errors as e

__all__ = ["INTERNAL", "Status", "error_class_of", "status_of"]


@dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int


# class -> (code, HTTP status); the reverse direction reads the same rows. Most specific class first.
TABLE: dict[type[e.StagetreeError], Status] = {
    e.InvalidArgument: Status(grpc.StatusCode.INVALID_ARGUMENT, 422),
    e.NotFound: Status(grpc.StatusCode.NOT_FOUND, 404),
    e.AlreadyExists: Status(grpc.StatusCode.ALREADY_EXISTS, 409),
    e.Unauthenticated: Status(grpc.StatusCode.UNAUTHENTICATED, 401),
    e.PermissionDenied: Status(grpc.StatusCode.PERMISSION_DENIED, 403),
    e.FailedPrecondition: Status(grpc.StatusCode.FAILED_PRECONDITION, 412),
    e.ResourceExhausted: Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 413),
    e.Conflict: Status(grpc.StatusCode.ABORTED, 409),
    e.Unavailable: Status(grpc.StatusCode.UNAVAILABLE, 503),
    e.StagetreeError: Status(grpc.StatusCode.UNKNOWN, 500),
}
# Raised by the gRPC library on the caller's side, never by the master: no answer in time, or a
# connection the transport tore down, is as retriable as no answer at all.
_TRANSPORT = {grpc.StatusCode.DEADLINE_EXCEEDED: e.Unavailable, grpc.StatusCode.CANCELLED: e.Unavailable}
_BY_CODE: dict[grpc.StatusCode, type[e.StagetreeError]] = {
    **{st.grpc: cls for cls, st in TABLE.items() if cls is not e.StagetreeError},
    **_TRANSPORT,
}
INTERNAL = Status(grpc.StatusCode.INTERNAL, 500)  # an exception outside the tree: a bug, logged with its traceback


def status_of(exc: BaseException) -> Status:
    """The status an error is answered with (the first class of its MRO in the table)."""
    for cls in type(exc).__mro__:
        st = TABLE.get(cls)
        if st is not None:
            return st
    return INTERNAL


def error_class_of(code: grpc.StatusCode | None) -> type[e.StagetreeError] | None:
    """The class a status code stands for; None for INTERNAL, UNKNOWN and the rest (a bug in the master
    or the client: not retriable, see the master's log)."""
    return _BY_CODE.get(code) if code is not None else None
