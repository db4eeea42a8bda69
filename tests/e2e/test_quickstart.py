"""The README's quickstart, run verbatim as a user would: saved as quickstart.py in an empty directory
and run there, its trainer imported by the workers from the script's directory (not from PYTHONPATH)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quickstart_code() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- quickstart -->\n```python\n(.*?)```", text, re.S)
    assert m is not None, "README.md has no <!-- quickstart --> python block"
    return m.group(1)


def test_the_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "quickstart.py").write_text(quickstart_code())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script's directory must suffice
    proc = subprocess.run(
        [sys.executable, "quickstart.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    m = re.search(r"best accuracy (0\.\d+) at step 40 with lr = (Warmup\(0\.01, 5, then=\w+\(.*\)\))", proc.stdout)
    assert m is not None, proc.stdout
    assert float(m.group(1)) > 0.8
    executed, alone = map(
        int, re.search(r"trained (\d+) steps; trial by trial would have trained (\d+)", proc.stdout).groups()
    )  # type: ignore[union-attr]
    assert executed < alone
