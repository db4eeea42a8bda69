"""Fixtures of the browser tests: one live embedded cluster per module, Chromium through Playwright."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.harness import LiveCluster, chromium_path

playwright_sync = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[dev]' installs playwright")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    c = LiveCluster(tmp_path_factory.mktemp("dashboard") / "home")
    yield c
    c.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium: `apt-get install -y chromium` (make test installs it)")
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = ctx.new_page()
    pg.set_default_timeout(30_000)
    yield pg
    ctx.close()


def sign_in(page: Any, live: LiveCluster, token: str | None = None, where: str = "#/") -> None:
    """Open the sign-in URL ``stagetree up`` prints, then go to ``where``."""
    page.goto(f"{live.url}/dashboard/#token={token or live.token}")
    page.wait_for_selector("#studies-table")
    if where != "#/":
        page.evaluate("where => { location.hash = where }", where)
