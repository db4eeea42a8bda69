"""One master per home: the home's OS file lock refuses a second holder, names the one that has it and
what to do, and goes with its holder however that ends (nothing stale after a kill -9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stagetree.core.errors import FailedPrecondition
from stagetree.homelock import HomeLock, holder

HOLD = """
import sys, time
from pathlib import Path
from stagetree.homelock import HomeLock
lock = HomeLock.acquire(Path(sys.argv[1]))
lock.note(target="127.0.0.1:50999")
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_holder_in_this_process_is_refused_until_the_first_releases(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = HomeLock.acquire(home)
    first.note(target="127.0.0.1:50051")
    with pytest.raises(FailedPrecondition) as err:
        HomeLock.acquire(home)
    message = err.value.message
    assert f"process {os.getpid()}" in message and "gRPC 127.0.0.1:50051" in message
    assert f"kill {os.getpid()}" in message and "--home DIR" in message and "EmbeddedSettings(home=" in message
    first.release()
    HomeLock.acquire(home).release()  # free again
    assert holder(home) == {}  # and the file no longer names anyone


def test_another_process_is_named_and_its_lock_goes_with_it_when_it_is_killed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(home)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(FailedPrecondition) as err:
            HomeLock.acquire(home)
        assert f"process {proc.pid}" in err.value.message and "127.0.0.1:50999" in err.value.message
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while True:  # the kernel drops the lock with the process; nothing to clean up
            try:
                HomeLock.acquire(home).release()
                break
            except FailedPrecondition:
                assert time.monotonic() < deadline, "the lock outlived its holder"
                time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
