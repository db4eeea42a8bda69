"""The vendored ECharts is the pinned release, unmodified, with its licence (as the protobuf code is
checked for freshness): update it only with ``scripts/vendor_echarts.py VERSION``."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import stagetree.dashboard

STATIC = Path(stagetree.dashboard.__file__).parent / "static"
ROOT = Path(__file__).resolve().parents[3]


def test_echarts_matches_the_pinned_version_and_checksum() -> None:
    pin = json.loads((STATIC / "vendor" / "echarts.json").read_text())
    data = (STATIC / "vendor" / "echarts.min.js").read_bytes()
    assert hashlib.sha256(data).hexdigest() == pin["sha256"], "echarts.min.js changed: run scripts/vendor_echarts.py"
    assert f'.version="{pin["version"]}"'.encode() in data  # the build says which release it is
    assert "Apache License" in (STATIC / "vendor" / "ECHARTS-LICENSE").read_text()


def test_the_static_files_ship_in_the_wheel() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = cfg["tool"]["setuptools"]["package-data"]["stagetree.dashboard"]
    shipped = {p for pat in patterns for p in STATIC.parent.glob(pat)}
    wanted = {p for p in STATIC.rglob("*") if p.is_file()}
    assert wanted <= shipped, sorted(str(p) for p in wanted - shipped)
    for name in (
        "index.html",
        "app.js",
        "common.js",
        "studies.js",
        "study.js",
        "trial.js",
        "tree.js",
        "cluster.js",
        "style.css",
    ):
        assert (STATIC / name).is_file()
