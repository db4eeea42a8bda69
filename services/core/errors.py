"""The one error tree of stagetree.

Every layer raises these; the API adapters translate them to gRPC status codes and HTTP statuses,
and the client SDK turns status codes back into the same classes::

    StagetreeError                      (retriable: False)
    ├── InvalidArgument                 bad input: a malformed config, a negative step    -> 400/422, INVALID_ARGUMENT
    │   └── SequenceError               a bad sequence parameter, names the field
    ├── NotFound                        unknown study / request / node                    -> 404, NOT_FOUND
    ├── AlreadyExists                   a name that is taken                              -> 409, ALREADY_EXISTS
    ├── Unauthenticated                 no or unknown token                               -> 401, UNAUTHENTICATED
    ├── PermissionDenied                a token that may not touch this study             -> 403, PERMISSION_DENIED
    ├── FailedPrecondition              the system is not in a state to do it (old schema) -> 412, FAILED_PRECONDITION
    ├── ResourceExhausted               an oversized batch, a quota                       -> 413, RESOURCE_EXHAUSTED
    ├── Conflict        (retriable)     a concurrent writer won; retrying can succeed     -> 409, ABORTED
    └── Unavailable     (retriable)     a dependency is down; retrying later can succeed  -> 503, UNAVAILABLE

Each message says what to do about it.
"""

from __future__ import annotations


class StagetreeError(Exception):
    """Base of every error stagetree raises on purpose."""

    retriable: bool = False
    code: str = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(StagetreeError):
    code = "INVALID_ARGUMENT"


class SequenceError(InvalidArgument):
    """A sequence with a bad parameter. ``field`` names the parameter (``"gamma"``, ``"milestones[1]"``)."""

    def __init__(self, family: str, field: str, message: str) -> None:
        super().__init__(f"{family}: {field}: {message}")
        self.family = family
        self.field = field


class NotFound(StagetreeError):
    code = "NOT_FOUND"


class AlreadyExists(StagetreeError):
    code = "ALREADY_EXISTS"


class Unauthenticated(StagetreeError):
    code = "UNAUTHENTICATED"


class PermissionDenied(StagetreeError):
    code = "PERMISSION_DENIED"


class FailedPrecondition(StagetreeError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(StagetreeError):
    code = "RESOURCE_EXHAUSTED"


class Conflict(StagetreeError):
    retriable = True
    code = "ABORTED"


class Unavailable(StagetreeError):
    retriable = True
    code = "UNAVAILABLE"


ALL_ERRORS: tuple[type[StagetreeError], ...] = (
    StagetreeError,
    InvalidArgument,
    SequenceError,
    NotFound,
    AlreadyExists,
    Unauthenticated,
    PermissionDenied,
    FailedPrecondition,
    ResourceExhausted,
    Conflict,
    Unavailable,
)
