"""A tuner script that starts the embedded mode at its top level, with no ``if __name__ == "__main__":``
guard, works: workers are forked without re-importing the script (which would run it again in every
worker, and fail there)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import asyncio, stagetree
from pathlib import Path
from stagetree.embedded import Embedded, EmbeddedSettings

print("top level ran")


async def go():
    async with Embedded(EmbeddedSettings(home=Path({home!r}), workers=2)) as cluster:
        async with stagetree.connect(cluster.target, token=cluster.token) as client:
            study = await stagetree.Study.create(
                client, "no-guard", trainer="stagetree.nodemanager.examples.digits:DigitsMLP", seed=0, tuned=["lr"]
            )
            got = await asyncio.gather(*(study.eval({{"lr": lr}}, 10) for lr in (0.05, 0.1)))
            print("accuracies", [round(m["accuracy"], 3) for m in got])

asyncio.run(go())
"""


def test_a_script_without_a_main_guard_runs_its_study_once(tmp_path: Path) -> None:
    script = tmp_path / "tune.py"
    script.write_text(SCRIPT.format(home=str(tmp_path / "home")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("top level ran") == 1  # not again in each worker
    assert "accuracies [" in done.stdout
    assert "bootstrapping phase" not in done.stderr
