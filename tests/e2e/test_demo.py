"""`make demo` as a user runs it: the example script end to end in embedded mode, in its own process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_runs_and_reports_what_sharing_bought(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits_sha.py"), "--home", str(tmp_path / "home")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"best accuracy\s+0\.\d+ at step 90", out), out
    m = re.search(r"steps executed\s+(\d+)\s+vs\s+(\d+) a trial-by-trial system would run \((\d+) unique\)", out)
    assert m is not None, out
    executed, trial_by_trial, unique = map(int, m.groups())
    assert executed == unique < trial_by_trial  # every step trained once, fewer than trial by trial
    assert float(re.search(r"merge rate\s+([\d.]+)", out).group(1)) > 1.5  # type: ignore[union-attr]
