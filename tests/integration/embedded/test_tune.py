"""``stagetree.tune``: the common path in one call, on a real embedded cluster. From a running event loop
(as in a notebook cell) it runs in a thread of its own; from a script, a trainer class defined in the
script itself is found by the workers under the script's module name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import stagetree
from stagetree import GridSearchSpace, MultiStep
from stagetree.nodemanager.examples.digits import DigitsMLP

VALUES = {"hidden": 16, "minibatches": 2}


async def test_tune_from_a_running_loop_returns_the_best_trial_and_a_table(tmp_path: Path) -> None:
    space = GridSearchSpace({"lr": [0.05, 0.1, MultiStep(0.1, [5], 0.5)]})
    result = stagetree.tune(  # blocking, as in a notebook cell: its own loop runs in a thread
        DigitsMLP, space, "asha", metric="accuracy", eta=2, min_step=5, max_step=10, max_concurrent=2,
        values=VALUES, home=tmp_path / "home", progress=False,
    )  # fmt: skip
    assert result.study == "stagetree.nodemanager.examples.digits:DigitsMLP" and not result.interrupted
    assert result.best is not None and result.best.step == 10 and "accuracy" in result.best.metrics
    table = result.trials
    assert len(table) == 3 and set(table["lr"]) == {"0.05", "0.1", "MultiStep(0.1, [5], 0.5)"}
    assert set(table["status"]) <= {"done", "pruned"} and (table["status"] == "done").any()
    assert result.best.metrics["accuracy"] == table[table["step"] == 10]["accuracy"].max()
    assert result.stats is not None and 0 < result.stats.steps_executed <= result.stats.trial_by_trial_steps


SCRIPT = """
import stagetree
from stagetree.nodemanager.examples.digits import DigitsMLP


class Local(DigitsMLP):  # defined in the script the user runs: __main__
    pass


if __name__ == "__main__":
    space = stagetree.GridSearchSpace({"lr": [0.05, 0.1]})
    result = stagetree.tune(Local, space, "grid", metric="accuracy", max_step=5, values={"hidden": 16},
                            home=".home", progress=False)
    print("study", result.study)
    print("best", result.best.step, round(result.best.metrics["accuracy"], 3))
"""


def test_a_trainer_defined_in_the_running_script_is_imported_by_its_file_name(tmp_path: Path) -> None:
    (tmp_path / "my_sweep.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "my_sweep.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "study my_sweep:Local" in proc.stdout and "best 5 " in proc.stdout, proc.stdout
