"""The master suite uses the shared integration fixtures (tests/integration/conftest.py), and ``http``:
the REST app of the ``app`` fixture served by a real uvicorn on loopback."""

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from stagetree.master.api.rest import create_rest_app
from stagetree.master.app import MasterApp
from tests.integration.conftest import ADMIN_TOKEN, REDIS_URL, TOKENS, master_settings

__all__ = ["ADMIN_TOKEN", "REDIS_URL", "TOKENS", "master_settings"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def http(app: MasterApp) -> Iterator[httpx.Client]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_rest_app(app), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=10) as client:
        yield client
    server.should_exit = True
    thread.join(10)
