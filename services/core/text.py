"""What a valid name or id is, on every side of every API (REST, gRPC, the SDK) and in both stores, and
how deep a JSON document from a user may nest.

A text field is a ``str`` of at most ``max_len`` characters, encodable as UTF-8 (no lone surrogate, which
no database stores), and free of control characters (NUL is refused by PostgreSQL and kept by SQLite;
refusing it here makes the two stores agree). Integer ids fit a signed 64-bit column.

A JSON document (a REST body, a config or fixed part sent over gRPC as a JSON string) nests at most
``MAX_JSON_DEPTH`` arrays and objects: every parser, encoder and validator it meets recurses once per
level (Python's ``json``, pydantic, PostgreSQL's ``jsonb``), so a deeper one is refused before any of
them reads it. The deepest document the master reads is a trial config's sequence nested in another
(a ``warmup`` whose ``then`` is a ``piecewise`` of ``warmup`` ...), a dozen levels in practice.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Any

from stagetree.core.errors import InvalidArgument

INT64_MAX = 2**63 - 1
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: no backtracking on long strings
_NOT_A_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


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


def json_depth(doc: str | bytes) -> int:
    """How deeply ``doc`` nests arrays and objects, counted without parsing it (so without recursion):
    brackets inside strings do not count. Malformed JSON gets a count too; its parser refuses it later."""
    raw = doc.encode("utf-8", "surrogatepass") if isinstance(doc, str) else doc
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_A_BRACKET)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def check_json_depth(doc: str | bytes, what: str) -> None:
    """``InvalidArgument`` naming the limit when ``doc`` nests deeper than ``MAX_JSON_DEPTH``."""
    depth = json_depth(doc)
    if depth > MAX_JSON_DEPTH:
        raise InvalidArgument(
            f"{what}: JSON nested {depth} levels deep is over the limit of {MAX_JSON_DEPTH}; send a flatter document"
        )
