"""The README's quickstart, run verbatim as a user would: saved as quickstart.py in an empty directory
and run there, its trainer imported by the workers from the script's directory (not from PYTHONPATH)."""

from __future__ import annotations

import json
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


EDIT = ("torch.nn.Linear(30, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)", "torch.nn.Linear(30, 2)")
LIST_TRIALS = """
import asyncio, collections, json
import stagetree
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.integrations.records import study_trials

async def main():
    async with Embedded(EmbeddedSettings(home=".quickstart", workers=1)) as cluster:
        async with stagetree.connect(cluster.target, token=cluster.token) as client:
            trials = await study_trials(await stagetree.Study.load(client, "quickstart"))
    print(json.dumps(collections.Counter(t.code_version for t in trials if t.points)))

asyncio.run(main())
"""


def _run(cwd: Path, script: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, script], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_the_quickstart_after_an_edit_of_its_trainer_trains_again(tmp_path: Path) -> None:
    """The README's quickstart, run, its model edited, run again: the loaded study trains the new code on its
    own plan (nothing of the old code answers it), and keeps the old code's trials apart."""
    code = quickstart_code()
    assert EDIT[0] in code, "the README's quickstart model changed; update EDIT"
    (tmp_path / "quickstart.py").write_text(code)
    first = _run(tmp_path, "quickstart.py")
    (tmp_path / "quickstart.py").write_text(code.replace(*EDIT))
    second = _run(tmp_path, "quickstart.py")
    assert "new plan for the new code" in second  # the warning says what happened
    trained = [int(m) for m in re.findall(r"trained (\d+) steps", first + "\n" + second)]
    assert len(trained) == 2 and trained[1] > 0, (first, second)  # the edited trainer trained its own steps
    (tmp_path / "list_trials.py").write_text(LIST_TRIALS)
    by_version = json.loads(_run(tmp_path, "list_trials.py").strip().splitlines()[-1])
    assert len(by_version) == 2 and all(n >= 4 for n in by_version.values()), by_version
