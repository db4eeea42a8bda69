"""A trainer's text log lines: their bounds, and how the text a trainer logs becomes lines that fit them.

A trainer logs text with ``Trainer.log_text``; each line travels as one ``log_line`` worker event (the bus
message ``LogLine``) and is kept in the ledger with its batch attempt, so a request's record shows what
the training that served it printed. Bounds, so that a chatty trainer cannot fill the database or a
direct report (gRPC refuses a message over 4 MiB):

- a line holds at most ``MAX_LINE_CHARS`` characters (a longer one is cut, ending in ``CUT_MARK``);
- a batch attempt keeps at most ``MAX_LINES`` lines, numbered ``0 .. MAX_LINES - 1`` (``seq``); when
  its trainer logged more, the last of them is ``cap_notice()``, which says how many were not kept.

``MAX_LINES`` lines of ``MAX_LINE_CHARS`` characters, each written in JSON in at most six bytes (a
control character written as an escape), encode as bus messages in at most ~1.3 MB
(``tests/unit/runtime/test_log_lines.py``): a direct report stays well under 4 MiB with them and the
attempt's metrics, checkpoints and curve besides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_LINE_CHARS = 1000
MAX_LINES = 200
CUT_MARK = " [cut]"
_SURROGATE = re.compile("[\ud800-\udfff]")


def lines_of(text: object) -> list[str]:
    """The lines ``text`` (its ``str``) holds, each storable in either database and at most
    ``MAX_LINE_CHARS`` characters: split at line breaks (an empty text is one empty line), a trailing
    line break dropped, NUL (which PostgreSQL refuses) and lone surrogates (which UTF-8 cannot hold)
    replaced by U+FFFD."""
    s = str(text)
    if "\x00" in s:
        s = s.replace("\x00", "\ufffd")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        s = _SURROGATE.sub("\ufffd", s)
    return [cut(line) for line in (s.splitlines() or [""])]


def cut(line: str) -> str:
    """``line``, or its start ending in ``CUT_MARK`` when it is over ``MAX_LINE_CHARS`` characters."""
    if len(line) <= MAX_LINE_CHARS:
        return line
    return line[: MAX_LINE_CHARS - len(CUT_MARK)] + CUT_MARK


def cap_notice(dropped: int) -> str:
    """The last line an attempt keeps when its trainer logged more than ``MAX_LINES``: how many were not
    kept (``dropped``, this one's place included)."""
    return f"[stagetree] {dropped} more log lines of this batch attempt not kept (at most {MAX_LINES} are kept)"


@dataclass(frozen=True)
class LoggedLine:
    """A line of text a batch attempt's trainer logged: the attempt's ``seq``-th, logged at ``at`` (epoch
    seconds, the worker's clock) while the batch stood at (node, step). The master keeps them so, and the
    SDK's ``Study.logs`` returns them so."""

    batch_id: int
    attempt: int
    seq: int
    node: int
    step: int
    at: float
    line: str
