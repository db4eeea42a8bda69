"""One log line per event, with its fields, in every stagetree process.

``configure(level)`` installs ``KeyValueFormatter`` on stderr: the standard line, then each field a call
passed in ``extra={...}`` as ``key=value`` (values with spaces quoted), so an operator can grep
``batch_id=42`` across the master, the aggregators, the node managers and the workers.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_STANDARD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


def _value(v: object) -> str:
    text = str(v)
    return repr(text) if not text or any(c.isspace() for c in text) or "=" in text else text


class KeyValueFormatter(logging.Formatter):
    """The standard line plus the record's ``extra={...}`` fields as ``key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = {k: v for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS and not k.startswith("_")}
        if not extras:
            return line
        fields = " ".join(f"{k}={_value(v)}" for k, v in extras.items())
        head, sep, rest = line.partition("\n")  # a traceback stays below the line its fields belong to
        return f"{head} {fields}{sep}{rest}"


def configure(level: str | int = "INFO") -> None:
    """Log to stderr through ``KeyValueFormatter``. A process whose logging is set up already (a test
    runner, an application embedding stagetree) keeps its own handlers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(FORMAT))
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler])
