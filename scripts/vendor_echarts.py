#!/usr/bin/env python3
"""Vendor Apache ECharts into the dashboard: ``npm pack echarts@VERSION``, copy its built
``dist/echarts.min.js``, LICENSE and NOTICE under ``services/dashboard/static/vendor/`` and pin the
version and checksum in ``echarts.json`` (``tests/unit/dashboard/test_vendor.py`` checks the file
against it). Needs npm; a Python user of the dashboard needs neither npm nor Node.

    python scripts/vendor_echarts.py 5.6.0
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent.parent / "services" / "dashboard" / "static" / "vendor"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    version = argv[0]
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(
            ["npm", "pack", f"echarts@{version}", "--json"], cwd=d, check=True, capture_output=True, text=True
        )
        info = json.loads(out.stdout)[0]
        with tarfile.open(Path(d) / info["filename"]) as tar:
            tar.extractall(d, filter="data")
        pkg = Path(d) / "package"
        shutil.copyfile(pkg / "dist" / "echarts.min.js", VENDOR / "echarts.min.js")
        shutil.copyfile(pkg / "LICENSE", VENDOR / "ECHARTS-LICENSE")
        shutil.copyfile(pkg / "NOTICE", VENDOR / "ECHARTS-NOTICE")
    manifest = {
        "package": "echarts",
        "version": version,
        "file": "dist/echarts.min.js",
        "sha256": hashlib.sha256((VENDOR / "echarts.min.js").read_bytes()).hexdigest(),
        "npm_shasum": info["shasum"],
        "update": "python scripts/vendor_echarts.py VERSION (runs npm pack echarts@VERSION)",
    }
    (VENDOR / "echarts.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"echarts {version} vendored: sha256 {manifest['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
