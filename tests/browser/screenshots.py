"""Screenshots of every dashboard page from a run of the demo study (``examples/digits_sha.py``'s SHA
over 27 schedules), for the README:

    python -m tests.browser.screenshots [--out docs/img]

The cluster page is taken while the study runs (slots busy), the others once it has finished."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import stagetree
from stagetree.client.driver import drive
from stagetree.client.tuners import SHA
from tests.browser.harness import LiveCluster, chromium_path

ROOT = Path(__file__).resolve().parents[2]


def _demo() -> Any:
    spec = importlib.util.spec_from_file_location("digits_sha", ROOT / "examples" / "digits_sha.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def run_demo(live: LiveCluster) -> str:
    demo = _demo()
    c = live.cluster
    async with stagetree.connect(c.target, token=c.token) as client:
        study = await stagetree.Study.create(
            client,
            "digits-sha",
            trainer=demo.TRAINER,
            dataset="sklearn-digits",
            model="mlp-64",
            seed=0,
            values={"hidden": 64, "minibatches": 4},
            tuned=["lr", "bs", "momentum"],
        )
        tuner = SHA(demo.search_space(), metric="accuracy", mode="max", eta=3, min_step=10, max_step=demo.MAX_STEP)
        await drive(study, tuner)
        return study.id


def main(argv: list[str] | None = None) -> int:
    from playwright.sync_api import sync_playwright

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ns = p.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    path = chromium_path()
    if path is None:
        print("no Chromium: apt-get install -y chromium", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as d:
        live = LiveCluster(Path(d) / "home")
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
                page.goto(f"{live.url}/dashboard/#token={live.token}")
                page.wait_for_selector("#studies-table")
                running = asyncio.run_coroutine_threadsafe(run_demo(live), live.bg.loop)
                page.evaluate("location.hash = '#/cluster'")
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not page.locator("[data-slot] .progress").count():
                    page.wait_for_timeout(200)
                page.wait_for_timeout(300)
                page.screenshot(path=str(ns.out / "dashboard-cluster.png"), full_page=True)
                study_id = running.result(600)
                page.evaluate("location.hash = '#/'")
                page.wait_for_selector("#studies-table tr[data-study]")
                page.wait_for_timeout(500)
                page.screenshot(path=str(ns.out / "dashboard-studies.png"), full_page=True)
                page.evaluate(f"location.hash = '#/study/{study_id}'")
                page.on("console", lambda m: print("console:", m.text, file=sys.stderr))
                try:
                    page.wait_for_selector("#curves[data-ready='1']", timeout=20_000)
                except Exception:
                    page.screenshot(path=str(ns.out / "debug.png"))
                    raise
                page.wait_for_timeout(800)
                page.hover("#trials tbody tr:nth-child(1)")
                page.wait_for_timeout(300)
                page.screenshot(path=str(ns.out / "dashboard-study.png"), full_page=False)
                page.evaluate(f"location.hash = '#/tree/{study_id}'")
                page.wait_for_selector("#tree[data-ready='1']")
                page.wait_for_timeout(800)
                box = page.locator("#tree canvas").bounding_box()
                assert box is not None
                page.mouse.click(box["x"] + 40, box["y"] + box["height"] / 2)  # the root
                page.wait_for_timeout(300)
                page.screenshot(path=str(ns.out / "dashboard-tree.png"), full_page=True)
                browser.close()
        finally:
            live.close()
    for name in ("studies", "study", "tree", "cluster"):
        print(ns.out / f"dashboard-{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
