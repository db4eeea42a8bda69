"""A live embedded stagetree (master with REST and the dashboard, aggregator, node manager, real worker
processes) on a background event loop, and Debian's Chromium driven by Playwright, for the browser
tests, the screenshots and ``tests.bench.dashboard``.

Playwright's own browser download cannot work here: the tests launch ``/usr/bin/chromium`` (the
Makefile's test target installs it when missing)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Awaitable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from stagetree.embedded import Embedded, EmbeddedSettings

T = TypeVar("T")
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def chromium_path() -> str | None:
    for p in (os.environ.get("STAGETREE_CHROMIUM", ""), *CHROMIUM_CANDIDATES):
        if p and Path(p).exists():
            return p
    return shutil.which("chromium")


class Background:
    """An asyncio loop on a thread of its own: ``run`` a coroutine there from synchronous code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="browser-harness-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T] | Awaitable[T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class LiveCluster:
    """An embedded cluster with REST on a free port, started on a ``Background`` loop."""

    def __init__(self, home: Path, **settings: Any) -> None:
        self.bg = Background()
        opts: dict[str, Any] = {"workers": 2, "http_port": 0, "curve_max_per_s": 0.0, **settings}
        self.cluster = Embedded(EmbeddedSettings(home=home, **opts))
        self.bg.run(self.cluster.start(), timeout=180)
        self.url = self.cluster.http_url
        self.token = self.cluster.token

    def run(self, coro: Coroutine[Any, Any, T] | Awaitable[T], timeout: float = 300) -> T:
        return self.bg.run(coro, timeout)

    def close(self) -> None:
        try:
            self.bg.run(self.cluster.stop(), timeout=120)
        finally:
            self.bg.close()
