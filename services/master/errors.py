"""The one table from the core error tree to gRPC status codes and HTTP statuses.

Both API adapters translate through ``status_of``; an exception outside the tree is an internal
error (500 / INTERNAL) and is logged with its traceback by the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from stagetree.core import errors as e


@dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int


# Most specific first: the first class in the MRO that has an entry wins.
STATUS: dict[type[e.StagetreeError], Status] = {
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
INTERNAL = Status(grpc.StatusCode.INTERNAL, 500)


def status_of(exc: BaseException) -> Status:
    for cls in type(exc).__mro__:
        st = STATUS.get(cls)
        if st is not None:
            return st
    return INTERNAL
