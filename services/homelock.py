"""One master per stagetree home: an OS file lock on ``<home>/stagetree.lock``.

``Embedded`` (so ``stagetree up`` too) takes it before it opens the home's database. Two masters on one
home would each lead with their own in-process coordination: each places work on the slots of both
node managers it finds in the database (``slots 4/2 busy``), and their rounds fail on plan nodes the
other wrote. The lock is the kernel's (``flock``), held by an open file that no child process inherits
(Python opens files non-inheritable, and workers are started by exec): it goes with the process however
that ends, so a crash leaves nothing to clean up. The file says who holds it (pid, command, address),
for the message the next process shows.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from stagetree.core.errors import FailedPrecondition

LOCK_NAME = "stagetree.lock"


class HomeLock:
    """The lock on one home, held until ``release`` (or the process's end)."""

    def __init__(self, home: Path, fd: int) -> None:
        self.home = home
        self.path = home / LOCK_NAME
        self._fd: int | None = fd
        self._about: dict[str, Any] = {
            "pid": os.getpid(),
            "command": _command(),
            "since": time.time(),
        }

    @classmethod
    def acquire(cls, home: Path) -> HomeLock:
        """Lock ``home`` (created if missing) for this process, or raise ``FailedPrecondition`` naming the
        process that holds it and what to do."""
        home.mkdir(parents=True, exist_ok=True)
        fd = os.open(home / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FailedPrecondition(held_message(home, holder(home))) from None
        except BaseException:
            os.close(fd)
            raise
        lock = cls(home, fd)
        lock.note()
        return lock

    def note(self, **about: Any) -> None:
        """Say more about this holder in the lock file (``target=``: where clients reach it)."""
        self._about.update(about)
        if self._fd is None:
            return
        data = json.dumps(self._about, sort_keys=True).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # what a later reader finds is no one's
        os.close(fd)  # closing the last descriptor of the open file drops the lock


def _command() -> str:
    """This process's command line, short: ``stagetree up --home h``, ``train.py``, ``python -c``."""
    argv = sys.argv or [sys.executable]
    text = " ".join([Path(argv[0]).name or "python", *argv[1:]])
    return text if len(text) <= 200 else text[:197] + "..."


def holder(home: Path) -> dict[str, Any]:
    """What the lock file says of the process that holds it ({} when it says nothing readable)."""
    try:
        about = json.loads((home / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return about if isinstance(about, dict) else {}


def held_message(home: Path, about: dict[str, Any]) -> str:
    pid = about.get("pid")
    who = f"process {pid}" if pid else "another process"
    details = [str(about["command"])] if about.get("command") else []
    if about.get("target"):
        details.append(f"gRPC {about['target']}")
    if about.get("since"):
        details.append("since " + time.strftime("%H:%M:%S", time.localtime(float(about["since"]))))
    shown = f"{who} ({', '.join(details)})" if details else who
    stop = f"`kill {pid}`" if pid else "stop it"
    reach = f" (stagetree.connect({about['target']!r}, ...))" if about.get("target") else ""
    return (
        f"the stagetree home {home} is in use by {shown}: one master per home, or two masters would share "
        f"one database and each schedule onto the other's slots. Stop that one (Ctrl-C where it runs, or "
        f"{stop}), use it instead{reach}, or give this one a home of its own "
        "(EmbeddedSettings(home=...), or `stagetree up --home DIR`)"
    )
