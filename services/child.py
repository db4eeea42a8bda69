"""Child processes that die with the process that started them, started without forking Python.

A ``preexec_fn`` makes ``subprocess`` ``fork()`` the whole interpreter and run Python in the copy before
``exec``. In a process that holds gRPC channels (a test run, a user's script that used the SDK, a node
manager) gRPC's fork handlers then race its own threads, and the child can die before its command
runs (``epoll_wait error: Bad file descriptor``, a segfault). Without one, ``subprocess`` starts the child
with ``vfork`` (or ``posix_spawn``): no fork handler and no Python code runs in a copy of the parent.

So the child asks for its parent-death signal itself, after ``exec``: ``popen`` runs the command under a
prologue (``python -I -S -c``, a few milliseconds) that calls ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, checks
that the process that started it is still its parent (it may have died before the call), and ``exec``s
the command, which keeps the pid. Linux counts the exit of the *thread* that started a child as its
parent's death, so only a start from the main thread asks for the signal; from another thread, and off
Linux, the command runs as given.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

# argv: [ppid, command...]. prctl's option 1 is PR_SET_PDEATHSIG (<sys/prctl.h>); the signal survives
# exec (of anything but a set-user-ID binary). A parent gone before the call would never send it.
PROLOGUE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    signal.raise_signal(signal.SIGTERM)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dies_with_parent() -> bool:
    """Whether a child started here and now can have its parent-death signal (see the module doc)."""
    return sys.platform == "linux" and bool(sys.executable) and threading.current_thread() is threading.main_thread()


def command(argv: Sequence[str]) -> list[str]:
    """``argv`` run under the prologue that ties it to this process, when ``dies_with_parent()``."""
    if not dies_with_parent():
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", PROLOGUE, str(os.getpid()), *argv]


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)`` whose child is SIGTERM-ed when this process dies (from the
    main thread, on Linux), so an interrupted run leaves nothing behind. ``preexec_fn`` is refused: it is
    the fork this module exists to avoid. A missing executable raises ``FileNotFoundError`` here, as
    ``Popen`` would, not in the child."""
    if "preexec_fn" in kwargs:
        raise TypeError("child.popen never runs a preexec_fn (it would fork this process)")
    if shutil.which(argv[0], path=(kwargs.get("env") or os.environ).get("PATH")) is None:
        raise FileNotFoundError(2, "No such file or directory", argv[0])
    return subprocess.Popen(command(argv), **kwargs)
