"""Where a bench's last run is kept: ``tests/bench/results/<bench>.json``, and the page made from them.

A bench ends with ``print(record("master", line))``: the last line's ``key=value`` figures are parsed and
written with the line itself, the command that ran, the machine (cores, memory, CPU model), the date and
the commit, then ``docs/benchmarks.md`` is written again from every results file (``tests.bench.report``),
so a figure on that page is always one a command measured, never one copied by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def parse_line(line: str) -> dict[str, Any]:
    """``a=1 b=0.5 c=true d=nan e=NVIDIA-H100`` -> figures: numbers as numbers, true/false as booleans,
    nan as None (a figure not measured), anything else as text."""
    out: dict[str, Any] = {}
    for word in line.split():
        key, sep, raw = word.partition("=")
        if not sep or not key:
            continue
        out[key] = _value(raw)
    return out


def _value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("nan", "none", "null"):
        return None
    try:
        return int(raw.replace(",", "")) if raw.lstrip("-").replace(",", "").isdigit() else float(raw)
    except ValueError:
        return raw


def machine() -> dict[str, Any]:
    """What the figures were measured on: absolute rates only compare on the same machine and hour."""
    model = ""
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                model = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = 0.0
    with contextlib.suppress(ValueError, OSError):
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "cpu": model,
        "python": platform.python_version(),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, cwd=RESULTS
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def record(bench: str, line: str, *, extra: dict[str, Any] | None = None, command: str | None = None) -> str:
    """Keep ``line`` (the bench's last line) as ``results/<bench>.json`` and write the benchmarks page
    again; returns ``line`` for the caller to print."""
    doc = {
        "bench": bench,
        "figures": parse_line(line),
        "line": line,
        "command": command or "python -m tests.bench." + bench + "".join(f" {a}" for a in sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": _commit(),
        "machine": machine(),
        **(extra or {}),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{bench}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str, allow_nan=False) + "\n")
    os.replace(tmp, path)
    from tests.bench.report import write_pages

    write_pages()
    return line
