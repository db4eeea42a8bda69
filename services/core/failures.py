"""A failed request's error text, written by the node manager and read back by the dashboard.

The text a request keeps when its work failed is what was raised, the end of its traceback, and where
the whole story is (the worker's log on its node manager's host), cut to ``MAX_ERROR_CHARS`` from its
end::

    ValueError: injected fault in user code
    (traceback: its last 40 of 52 lines)
    Traceback (most recent call last):
      File ".../trainer.py", line 12, in train
    ...
    ValueError: injected fault in user code
    worker log: /srv/stagetree-nm/logs/batch-7-a1.log on node manager gpu-3

``log_note`` writes the last line (the node manager calls it); ``parse_failure`` takes the text apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LOG_NOTE = re.compile(r"^worker log: (?P<path>.+) on node manager (?P<nm>\S+)$")
_CUT = re.compile(r"^\(traceback: its last \d+ of \d+ lines\)$")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(: .*)?$")
_FRAME = re.compile(r'", line \d+, in ')


def log_note(path: str, node_manager: str) -> str:
    return f"worker log: {path} on node manager {node_manager}"


def worker_log_name(batch_id: int, attempt: int, suffix: str = "") -> str:
    """The name of a batch attempt's worker log in its node manager's ``<work dir>/logs/`` (``suffix``:
    ``-r<rank>`` for a rank of a batch on several slots), as the node manager writes it and the master
    names it where it cannot read it."""
    return f"batch-{batch_id}-a{attempt}{suffix}.log"


@dataclass(frozen=True)
class Failure:
    headline: str  # what was raised: one line
    traceback: str  # the traceback's lines kept with the request ("" when there were none)
    log_path: str = ""  # the worker's log on its node manager's host ("" when not said)
    node_manager: str = ""
    text: str = ""  # the whole text

    def to_json(self) -> dict[str, str]:
        return {
            "headline": self.headline,
            "traceback": self.traceback,
            "log_path": self.log_path,
            "node_manager": self.node_manager,
        }


def parse_failure(text: str) -> Failure:
    """The parts of a request's error text (any text: one that does not follow the layout above is
    all headline, or its first line is)."""
    lines = text.strip("\n").splitlines()
    path = nm = ""
    for i in range(len(lines) - 1, -1, -1):
        m = _LOG_NOTE.match(lines[i].strip())
        if m:
            path, nm = m["path"], m["nm"]
            del lines[i]
            break
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), None)
    if start is None:
        start = next((i + 1 for i, line in enumerate(lines) if _CUT.match(line)), None)
    if start is None and any(_FRAME.search(line) for line in lines):
        start = 0  # its start was cut away: what is left is the end of a traceback
    if start is None:
        head = next((line for line in lines if line.strip()), "")
        body = "\n".join(lines[1:]).strip("\n") if lines else ""
        return Failure(head, body, path, nm, text)
    head = next((line for line in lines[:start] if line.strip() and not _CUT.match(line)), "")
    tb = lines[start:]
    if not head:  # the start was cut away (the text keeps its end): the traceback's last line says it
        head = next((line for line in reversed(tb) if _RAISED.match(line)), tb[-1] if tb else "")
        tb = tb[next((i for i, line in enumerate(tb) if line.startswith('  File "')), 0) :]
    return Failure(head.strip(), "\n".join(tb).rstrip(), path, nm, text)
