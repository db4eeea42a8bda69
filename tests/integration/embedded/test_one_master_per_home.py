"""One master per home, as a user meets it: ``stagetree up`` on the home an ``Embedded()`` of this process
uses is refused with a message naming this process and what to do, and ``Embedded()`` on the home of a
running ``stagetree up`` is refused naming that process and its address; neither starts a second master
(two on one home placed work on each other's slots and failed their rounds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stagetree.core.errors import FailedPrecondition
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.homelock import LOCK_NAME


def _up(home: Path) -> list[str]:
    return [sys.executable, "-m", "stagetree.cli", "up", "--home", str(home), "--port", "0", "--http-port", "-1"]


async def test_stagetree_up_on_a_home_in_use_is_refused_naming_the_process(tmp_path: Path) -> None:
    home = tmp_path / "home"
    async with Embedded(EmbeddedSettings(home=home, workers=1)) as cluster:
        out = subprocess.run([*_up(home), "--workers", "1"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"in use by process {os.getpid()}" in out.stderr and f"gRPC {cluster.target}" in out.stderr
        assert "--home DIR" in out.stderr and "Traceback" not in out.stderr
        assert "stagetree embedded: gRPC" not in out.stdout  # no second master came up
        overview = cluster.app.store.stats.overview()
        assert overview.slots == 1  # this master's one slot, nobody else's


async def test_embedded_on_the_home_of_a_running_stagetree_up_is_refused_naming_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = subprocess.Popen([*_up(home), "--workers", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        about: dict[str, object] = {}
        while "target" not in about:  # it has its address once its gRPC server is up
            assert time.monotonic() < deadline and proc.poll() is None, "stagetree up did not start"
            time.sleep(0.1)
            try:
                about = json.loads((home / LOCK_NAME).read_text() or "{}")
            except (OSError, ValueError):
                about = {}
        with pytest.raises(FailedPrecondition) as err:
            async with Embedded(EmbeddedSettings(home=home, workers=1)):
                pass
        assert f"in use by process {proc.pid}" in err.value.message
        assert f"gRPC {about['target']}" in err.value.message and f"up --home {home}" in err.value.message
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0
