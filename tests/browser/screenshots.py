"""Screenshots of every dashboard page, for docs/dashboard.md, from a run as a researcher would make it:
ASHA over the demo's 27 warmup-then-decay schedules (``examples/digits_sha.py``'s search space) on the
digits MLP, where the three trials whose learning rate is still 0.2 at step 8 raise two frames deep in
the trainer (``FaultyDigits``' ``fault_lr_above``), beside a small second study:

    python -m tests.browser.screenshots [--out docs/img]

The cluster page is taken while the study runs (slots busy), the others once it has finished. The
10,000-node stage tree is ``python -m tests.bench.dashboard --shots docs/img``'s."""

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
from stagetree.client.tuners import ASHA
from stagetree.core.sequences import MultiStep
from stagetree.nodemanager.examples.faults import ENTRY_POINT as FAULTY
from tests.browser.harness import LiveCluster, chromium_path

ROOT = Path(__file__).resolve().parents[2]
VALUES = {"hidden": 64, "minibatches": 4, "fault": "raise", "fault_step": 8, "fault_lr_above": 0.1999}
PAGES = ("studies", "study", "study-choices", "trial", "tree", "cluster")


def _demo() -> Any:
    spec = importlib.util.spec_from_file_location("digits_sha", ROOT / "examples" / "digits_sha.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def run_asha(live: LiveCluster) -> str:
    demo = _demo()
    c = live.cluster
    async with stagetree.connect(c.target, token=c.token) as client:
        study = await stagetree.Study.create(
            client, "digits-asha", trainer=FAULTY, dataset="sklearn-digits", model="mlp-64", seed=0,
            values=VALUES, tuned=["lr", "bs", "momentum"],
        )  # fmt: skip
        tuner = ASHA(
            demo.search_space(), metric="accuracy", mode="max", eta=3, min_step=10, max_step=90, max_concurrent=6
        )
        await drive(study, tuner)
        return study.id


async def run_small(live: LiveCluster) -> str:
    c = live.cluster
    async with stagetree.connect(c.target, token=c.token) as client:
        study = await stagetree.Study.create(
            client,
            "digits-momentum",
            trainer=FAULTY,
            seed=1,
            values={"hidden": 32, "minibatches": 2},
            tuned=["lr", "momentum"],
        )
        evs = [
            study.submit({"lr": 0.1, "momentum": MultiStep(0.5, [10], g)}, 30, label=f"m{g}") for g in (1.2, 1.6, 1.8)
        ]
        await asyncio.gather(*evs, return_exceptions=True)
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
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        live = LiveCluster(Path(d) / "home", workers=3)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1500, "height": 1000}, device_scale_factor=1)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on(
                    "response",
                    lambda r: (
                        errors.append(f"{r.status} {r.url}") if r.status >= 400 and "favicon" not in r.url else None
                    ),
                )
                page.goto(f"{live.url}/dashboard/#token={live.token}")
                page.wait_for_selector("#studies-table")
                small = live.run(run_small(live))
                running = asyncio.run_coroutine_threadsafe(run_asha(live), live.bg.loop)
                page.evaluate("location.hash = '#/cluster'")
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and page.locator("[data-slot] .progress").count() < 2:
                    page.wait_for_timeout(200)
                page.wait_for_timeout(3000)
                page.screenshot(path=str(ns.out / "dashboard-cluster.png"), full_page=True)
                study_id = running.result(900)
                del small
                page.evaluate("location.hash = '#/'")
                page.wait_for_selector("#studies-table tr[data-study]")
                page.wait_for_timeout(500)
                page.screenshot(path=str(ns.out / "dashboard-studies.png"))
                page.evaluate(f"location.hash = '#/study/{study_id}'")
                page.wait_for_selector("#curves[data-ready='1']")
                page.wait_for_selector("#eval-curves[data-ready='1']")
                page.wait_for_timeout(800)
                page.hover("#trials tbody tr:nth-child(2)")
                page.wait_for_timeout(300)
                page.screenshot(path=str(ns.out / "dashboard-study.png"))
                page.locator("#parallel").scroll_into_view_if_needed()
                page.wait_for_selector("#contour[data-ready='1']")
                page.wait_for_timeout(300)
                # the whole "Tuned choices" card: parallel coordinates, importance, history, slices, contour
                page.locator("div.card:has(#parallel)").screenshot(path=str(ns.out / "dashboard-study-choices.png"))
                page.select_option("#state-filter", "failed")
                page.click("#trials tbody tr[data-state=FAILED]")
                page.wait_for_selector("#traceback")
                page.wait_for_selector("#trial-curve[data-ready='1']")
                page.wait_for_timeout(500)
                page.screenshot(path=str(ns.out / "dashboard-trial.png"), full_page=True)
                page.evaluate(f"location.hash = '#/tree/{study_id}'")
                page.wait_for_selector("#tree[data-ready='1']")
                page.wait_for_timeout(500)
                page.fill("#tree-search", "failed")
                page.press("#tree-search", "Enter")
                page.wait_for_selector("#node-trials")
                page.wait_for_timeout(500)
                page.screenshot(path=str(ns.out / "dashboard-tree.png"))
                browser.close()
        finally:
            live.close()
    for name in PAGES:
        print(ns.out / f"dashboard-{name}.png")
    if errors:
        print("page errors:\n" + "\n".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
