"""The one table between the core error tree and the wire: each error class's gRPC status code and HTTP
status, and back from every status code to a class.

The master's adapters (gRPC and REST) answer through :func:`status_of`; the SDK and the node-manager link
turn a received code back into the same class through :func:`error_class_of` / :func:`error_of_code`.
Whether a caller retries is the class's ``retriable`` flag (``Unavailable``, ``Conflict``) and nothing
else. A code no handler sends on purpose (INTERNAL, UNKNOWN, ...) becomes the base ``StagetreeError``:
not retriable, its message saying it is a bug and to look at the master's log. Not in ``core``: core
imports no I/O library.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from stagetree.core import errors as e

__all__ = ["INTERNAL", "SERVER_BUG", "TABLE", "Status", "error_class_of", "error_of_code", "status_of"]


@dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int


# class -> (code, HTTP status); the reverse direction reads the same rows, as each code appears once
# (AlreadyExists and Conflict share only HTTP 409). Most specific class first.
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
    # raised on purpose but as none of the leaves: the master's own mistake, like INTERNAL
    e.StagetreeError: Status(grpc.StatusCode.UNKNOWN, 500),
}
INTERNAL = Status(grpc.StatusCode.INTERNAL, 500)  # an exception outside the tree: a bug, logged with its traceback

SERVER_BUG = "this is a bug in the master: see the master's log"

# What a caller receives beyond the table's rows. The gRPC library raises DEADLINE_EXCEEDED itself when no
# answer came in time, which a retry fixes as well as no answer at all (callers retry idempotent calls
# only). A master that stops answers UNAVAILABLE, so CANCELLED is a call cancelled on purpose: no retry.
_RECEIVED: dict[grpc.StatusCode, type[e.StagetreeError]] = {
    **{st.grpc: cls for cls, st in TABLE.items()},
    grpc.StatusCode.DEADLINE_EXCEEDED: e.Unavailable,
}
# The codes outside the table that are not a bug, and what to do about them.
_HINTS: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.CANCELLED: "the call was cancelled before it finished (by this process, or by the master)",
    grpc.StatusCode.UNIMPLEMENTED: "the server does not serve this call: is it a stagetree master of this version?",
}


def status_of(exc: BaseException) -> Status:
    """The status an error is answered with (the first class of its MRO in the table), else ``INTERNAL``."""
    for cls in type(exc).__mro__:
        st = TABLE.get(cls)
        if st is not None:
            return st
    return INTERNAL


def error_class_of(code: grpc.StatusCode) -> type[e.StagetreeError]:
    """The class a received code stands for; the base ``StagetreeError`` (not retriable) for INTERNAL,
    UNKNOWN, CANCELLED and every other code outside the table: retrying a bug only repeats it."""
    return _RECEIVED.get(code, e.StagetreeError)


def error_of_code(code: grpc.StatusCode, message: str) -> e.StagetreeError:
    """The error for a received ``code``; ``message`` says which call failed and the server's details. For
    a code outside the table, the code's name and what to do about it are appended."""
    cls = error_class_of(code)
    if cls is not e.StagetreeError:
        return cls(message)
    return e.StagetreeError(f"{message} ({code.name}); {_HINTS.get(code, SERVER_BUG)}")
