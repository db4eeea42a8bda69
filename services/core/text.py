"""What a valid name or id is, on every side of every API (REST, gRPC, the SDK) and in both stores.

A text field is a ``str`` of at most ``max_len`` characters, encodable as UTF-8 (no lone surrogate, which
no database stores), and free of control characters (NUL is refused by PostgreSQL and kept by SQLite;
refusing it here makes the two stores agree). Integer ids fit a signed 64-bit column.
"""

from __future__ import annotations

import re
from typing import Any

from stagetree.core.errors import InvalidArgument

INT64_MAX = 2**63 - 1
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_text(value: Any, what: str, max_len: int, *, empty: bool = False) -> str:
    """``value`` as a valid text field, or ``InvalidArgument`` saying what is wrong with it."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what}: must be a string, got {type(value).__name__}")
    if not value and not empty:
        raise InvalidArgument(f"{what}: must not be empty")
    if len(value) > max_len:
        raise InvalidArgument(f"{what}: {len(value)} characters is over the limit of {max_len}")
    if _CONTROL.search(value):
        raise InvalidArgument(f"{what}: must not contain control characters (such as NUL or a newline)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what}: is not valid Unicode text (a lone surrogate)") from None
    return value


def check_id(value: Any, what: str) -> int:
    """A positive integer id that fits the stores' 64-bit columns."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= INT64_MAX:
        raise InvalidArgument(f"{what}: must be an integer in [1, {INT64_MAX}], got {value!r}")
    return value
