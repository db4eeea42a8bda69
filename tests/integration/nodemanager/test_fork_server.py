"""The worker fork server holds neither gRPC nor a CUDA context when it forks (``nodemanager.workers``):
started from a process busy with gRPC (a node manager's channels), it comes up clean, and a server that
would hold gRPC is refused before any worker is forked from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stagetree.nodemanager.workers import fork_server_holds

ROOT = Path(__file__).resolve().parents[3]

# multiprocessing keeps one fork server per process, preloaded when it first starts: each case runs in
# a process of its own, beside live gRPC channels as a node manager's.
_START = """
import asyncio, sys
from pathlib import Path
from stagetree.core.errors import FailedPrecondition
from stagetree.nodemanager.workers import ForkserverLauncher
from tests.grpc_noise import busy_grpc

work = Path(sys.argv[1])
launcher = ForkserverLauncher(str(work / "ckpt"), work, prestart=False, preload=sys.argv[2:])
with busy_grpc():
    try:
        asyncio.run(launcher.start([]))
    except FailedPrecondition as e:
        print("refused:", e.message)
    else:
        print("started")
"""


def _start_fork_server(work: Path, *preload: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _START, str(work), *preload],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # gRPC's C core logs there as the channels close (a GOAWAY, say)
        text=True,
    )


def test_a_fork_server_started_beside_grpc_holds_none_and_one_that_would_is_refused(tmp_path: Path) -> None:
    assert fork_server_holds() == ["grpc"]  # this test process imported it: the check sees it
    (tmp_path / "clean").mkdir()
    (tmp_path / "grpc").mkdir()
    clean = _start_fork_server(tmp_path / "clean", "torch._dynamo")
    holding = _start_fork_server(tmp_path / "grpc", "torch._dynamo", "grpc")
    out_clean, err_clean = clean.communicate(timeout=300)
    out_holding, err_holding = holding.communicate(timeout=300)
    assert out_clean.splitlines()[-1:] == ["started"], out_clean + err_clean
    last = (out_holding.splitlines() or [""])[-1]
    assert last.startswith("refused: the worker fork server holds grpc"), out_holding + err_holding
    assert "worker_start=exec" in last
