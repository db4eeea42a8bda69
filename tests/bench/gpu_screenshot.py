"""The dashboard's Cluster page drawn from a cluster view the GPU bench recorded on the GPU machine.

    python -m tests.bench.gpu_screenshot VIEW.json [--out tests/bench/results/gpu-h200-cluster.png]

``tests.bench.gpu --snapshots DIR`` reads ``GET /api/v1/dashboard/cluster`` every second while its packing
study runs on the GPU and keeps the busiest answer: the slots and their batches, and the GPU telemetry the
node manager's NVML probe sent through the aggregator. The GPU machine has no browser, so this draws the
page here: a local embedded cluster serves the dashboard, and Playwright (Debian's Chromium) opens its
Cluster page with that one request answered by the recorded view. Everything else on the page (its code,
styles, charts) is the dashboard's own. Exits 1 when the view holds no GPU telemetry or the page shows none.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.browser.harness import LiveCluster, chromium_path

ROOT = Path(__file__).resolve().parents[2]


def gpu_rows(view: dict[str, Any]) -> int:
    return sum(len(nm.get("gpus") or []) for nm in view.get("node_managers", []))


def shoot(view: dict[str, Any], out: Path) -> int:
    """Draw ``view`` on the Cluster page and save it to ``out``; the number of GPU rows the page shows."""
    from playwright.sync_api import Route, sync_playwright

    path = chromium_path()
    if path is None:
        raise RuntimeError("no Chromium: apt-get install -y chromium")
    body = json.dumps(view)
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        live = LiveCluster(Path(d) / "home", workers=1)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1500, "height": 1000}, device_scale_factor=1)
                page.on("pageerror", lambda e: errors.append(str(e)))

                def recorded(route: Route) -> None:
                    route.fulfill(status=200, content_type="application/json", body=body)

                page.route("**/api/v1/dashboard/cluster", recorded)
                page.goto(f"{live.url}/dashboard/#token={live.token}")
                page.wait_for_selector("#studies-table")
                page.evaluate("location.hash = '#/cluster'")
                page.wait_for_selector("#utilisation[data-ready='1']")
                page.wait_for_timeout(1500)
                out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out), full_page=True)
                shown = page.locator("#hosts h3:has-text('GPUs') + table tr").count() - 1
                browser.close()
        finally:
            live.close()
    if errors:
        raise RuntimeError(f"the page raised: {errors[:3]}")
    return max(shown, 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.gpu_screenshot", description=__doc__.splitlines()[0])
    p.add_argument("view", type=Path, help="a cluster-<configuration>.json that tests.bench.gpu --snapshots wrote")
    p.add_argument("--out", type=Path, default=None, help="the PNG (default: beside the view, same name)")
    ns = p.parse_args(argv)
    view = json.loads(ns.view.read_text())
    if gpu_rows(view) == 0:
        print(f"{ns.view}: no GPU telemetry in this view (recorded without a GPU?)", file=sys.stderr)
        return 1
    out = ns.out or ns.view.with_suffix(".png")
    shown = shoot(view, out)
    print(f"{out}: the Cluster page with {shown} GPU row(s) of telemetry")
    return 0 if shown > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
