"""The embedded mode forks its workers' fork server from the user's script where that is safe
(``nodemanager.workers.fork_this_process``): the workers then hold the trainer module the script imported
and never import it again, and they train exactly what a fresh fork server's workers train. Where the
script already runs another thread or gRPC when the cluster starts, the fork server is a fresh interpreter,
and the study runs the same. The script's teardown skips the cyclic collector (``embedded.freeze_at_exit``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from stagetree.nodemanager.workers import fork_unsafe_reason

# A user's trainer module: each process that imports it appends its pid to a file.
TRAINER = """
import os
from stagetree.nodemanager.examples.digits import DigitsMLP

VERSION = 1
with open(os.environ["IMPORTS_FILE"], "a") as f:
    f.write(f"{os.getpid()}:{VERSION}\\n")


class Net(DigitsMLP):
    pass
"""

SCRIPT = """
import asyncio, atexit, gc, json, sys, threading
from pathlib import Path

# registered before the cluster's own handler, so it runs after it: what the collector skips at exit
atexit.register(lambda: print(json.dumps({"frozen_at_exit": gc.get_freeze_count()})))

import my_trainer  # the user's module, as a tuner script imports its model's
import stagetree
from stagetree.embedded import Embedded, EmbeddedSettings

home, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "thread":  # a thread of the script's own runs when the cluster starts
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()


async def go():
    settings = EmbeddedSettings(home=home, workers=1, fork_workers_from_script=mode != "fresh", progress=False)
    async with Embedded(settings) as cluster:
        async with stagetree.connect(cluster.target, token=cluster.token) as client:
            study = await stagetree.Study.create(client, "fork", trainer="my_trainer:Net", seed=0, tuned=["lr"])
            got = await asyncio.gather(*(study.eval({"lr": lr}, 6) for lr in (0.05, 0.1)))
            if mode == "edit":  # the user edits the trainer's module, and runs the study again
                source = Path("my_trainer.py")
                source.write_text(source.read_text().replace("VERSION = 1", "VERSION = 2"))
                again = await stagetree.Study.create(client, "fork2", trainer="my_trainer:Net", seed=0, tuned=["lr"])
                await again.eval({"lr": 0.05}, 6)
        print(json.dumps({"fork": cluster.worker_fork, "results": got, "frozen": gc.get_freeze_count()}))

asyncio.run(go())
"""


def _run(tmp_path: Path, mode: str) -> tuple[dict, list[str]]:
    work = tmp_path / mode
    work.mkdir()
    (work / "my_trainer.py").write_text(TRAINER)
    (work / "tune.py").write_text(SCRIPT)
    imports = work / "imports.txt"
    done = subprocess.run(
        [sys.executable, str(work / "tune.py"), str(work / "home"), mode],
        cwd=work,
        env={**_env(), "IMPORTS_FILE": str(imports)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    *_, result, at_exit = done.stdout.strip().splitlines()
    return {**json.loads(result), **json.loads(at_exit)}, imports.read_text().split()


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_workers_forked_from_the_script_never_import_its_trainer_again_and_train_the_same(tmp_path: Path) -> None:
    forked, forked_imports = _run(tmp_path, "script")
    fresh, fresh_imports = _run(tmp_path, "fresh")
    assert forked["fork"] == "script"
    assert len(forked_imports) == 1  # the script's import: its workers hold the module
    assert fresh["fork"] == "none"
    assert len(fresh_imports) == 2  # the script's, and the worker's own
    assert forked["results"] == fresh["results"]
    # the script's objects stay under the collector while it runs; its teardown skips them
    assert forked["frozen"] == fresh["frozen"] == 0
    assert forked["frozen_at_exit"] > 100_000 and fresh["frozen_at_exit"] > 100_000


def test_a_module_edited_after_the_fork_is_imported_again_by_the_next_worker(tmp_path: Path) -> None:
    got, imports = _run(tmp_path, "edit")
    assert got["fork"] == "script"
    script_pid = imports[0].split(":")[0]
    assert imports[0].endswith(":1")
    assert [line for line in imports[1:] if line.endswith(":2") and not line.startswith(script_pid)], imports


def test_a_script_running_another_thread_gets_a_fresh_fork_server(tmp_path: Path) -> None:
    got, imports = _run(tmp_path, "thread")
    assert got["fork"] == "fresh"
    assert len(imports) == 2
    assert len(got["results"]) == 2


def test_forking_is_refused_while_another_thread_runs() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    try:
        why = fork_unsafe_reason()
    finally:
        stop.set()
        t.join()
    assert why is not None and "thread" in why
