"""The first hour of a researcher who knows Optuna, replayed as that user in a temporary directory.

``python -m tests.bench.first_hour`` (about 3 minutes on 2 cores):

1. the README's quickstart, saved as ``quickstart.py`` and run in a pseudo-terminal (as a terminal shows
   it): whether progress was drawn, and the seconds from the script's start to its first result (the
   first ``best`` in the progress line), beside a plain Optuna script's seconds to its first finished trial
   on the same data and model, run the same way in the same run;
2. the quickstart's model edited and the script run again: whether the loaded study answered the new code
   with the old code's results (stale), judged from the study's trials by code version;
3. a trainer that raises for some configs, driven in a pty: how many failed trials were printed once each
   with the end of their traceback and their worker log;
4. one schedule, ``Warmup(0.01, 5, then=Cosine(0.1, 0.001, 40))``, as the SDK prints it fresh and loaded,
   as the CLI prints it, as REST returns it and as the Optuna export writes it: how many distinct forms;
5. every public tuner and space class: how many lack a docstring or an entry in docs/tuners.md.

The last line is the figures; ``tests.bench.record`` keeps them in ``tests/bench/results/first_hour.json`` with
the machine, the date and the commit.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path
from typing import Any

from tests.bench.record import record

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE_TEXT = "Warmup(0.01, 5, then=Cosine(0.1, 0.001, 40))"
EDIT = ("torch.nn.Linear(30, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)", "torch.nn.Linear(30, 2)")


def quickstart_code() -> str:
    m = re.search(r"<!-- quickstart -->\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert m is not None, "README.md has no <!-- quickstart --> block"
    return m.group(1)


def run_in_pty(args: list[str], cwd: Path, until: str | None = None, timeout_s: float = 300) -> tuple[str, int, float]:
    """Run ``args`` on a pseudo-terminal of 120x40 (stdout and stderr both), as a terminal would show it;
    returns (output, exit status, seconds from the start until ``until`` first appeared, or -1)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the user's shell running the script
        os.chdir(cwd)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        os.execve(args[0], args, env)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    t0 = time.monotonic()
    seen = -1.0
    out = bytearray()
    while time.monotonic() - t0 < timeout_s:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
            if until is not None and seen < 0 and until in out.decode(errors="replace"):
                seen = time.monotonic() - t0
    _, status = os.waitpid(pid, 0)
    return out.decode(errors="replace"), os.waitstatus_to_exitcode(status), seen


def run(args: list[str], cwd: Path, timeout_s: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


OPTUNA_PLAIN = """
import time
T0 = time.monotonic()
import optuna, torch
from sklearn.datasets import load_breast_cancer

torch.set_num_threads(1)  # as each stagetree worker trains (EmbeddedSettings.threads_per_worker)

x, y = load_breast_cancer(return_X_y=True)
x, y = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32), torch.tensor(y)
(xt, yt), (xe, ye) = (x[100:], y[100:]), (x[:100], y[:100])


def objective(trial):  # the quickstart's trial: 40 steps of one minibatch of 32, then the accuracy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=trial.suggest_float("lr", 0.001, 0.1, log=True), momentum=0.9)
    order = torch.randperm(len(xt))
    for step in range(40):
        i = order[(step * 32) % len(xt):][:32]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt[i]), yt[i]).backward()
        opt.step()
    return (model(xe).argmax(1) == ye).float().mean().item()


def first(study, trial):
    if len(study.trials) == 1:
        print(f"first trial done after {time.monotonic() - T0:.2f} s in-process", flush=True)


optuna.logging.set_verbosity(optuna.logging.WARNING)
optuna.create_study(direction="maximize").optimize(objective, n_trials=4, callbacks=[first])
"""

FAILING = """
import asyncio

import torch
from sklearn.datasets import load_breast_cancer

import stagetree
from stagetree import ASHA, Constant, GridSearchSpace, Warmup
from stagetree.embedded import Embedded, EmbeddedSettings


class Flaky(stagetree.TorchTrainer):
    def make_model(self):
        return torch.nn.Sequential(torch.nn.Linear(30, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def make_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def make_data(self):
        x, y = load_breast_cancer(return_X_y=True)
        x, y = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32), torch.tensor(y)
        return (x[100:], y[100:]), (x[:100], y[:100])

    def setup(self, hp_changes):
        if float(hp_changes.get("lr", 0.0)) > 0.2:
            raise ValueError(f"this trainer diverges with lr={hp_changes['lr']}")
        super().setup(hp_changes)


async def main():
    space = GridSearchSpace({"lr": [Warmup(0.01, 5, Constant(v)) for v in (0.05, 0.1, 0.3, 0.5, 0.08, 0.4)]})
    async with Embedded(EmbeddedSettings(home=".failing", workers=2)) as cluster:
        async with stagetree.connect(cluster.target, token=cluster.token) as client:
            study = await stagetree.Study.create(client, "failing", trainer="failing:Flaky", tuned=["lr"])
            tuner = ASHA(space, metric="accuracy", eta=2, min_step=10, max_step=20, max_concurrent=3)
            await stagetree.drive(study, tuner)
    print("FAILED_TRIALS", sorted(t.trial_id for t in tuner.trials.values() if t.status == "failed"))


if __name__ == "__main__":
    asyncio.run(main())
"""

LIST_TRIALS = """
import asyncio, collections, json
import stagetree
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.integrations.records import study_trials

async def main():
    async with Embedded(EmbeddedSettings(home=".quickstart", workers=1, progress=False)) as cluster:
        async with stagetree.connect(cluster.target, token=cluster.token) as client:
            trials = await study_trials(await stagetree.Study.load(client, "quickstart"))
    print(json.dumps(collections.Counter(t.code_version for t in trials if t.points)))

asyncio.run(main())
"""

FORMS = """
import asyncio, contextlib, io, json, re, urllib.request
import stagetree
from stagetree import Cosine, Warmup
from stagetree.client import cli
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.integrations.optuna import export_to_optuna
from stagetree.integrations.records import study_trials
from stagetree.core.seqforms import to_family_json

SEQ = Warmup(0.01, 5, Cosine(0.1, 0.001, 40))


async def main():
    forms = {"sdk_fresh": repr(SEQ)}
    settings = EmbeddedSettings(home=".forms", workers=1, http_port=0, progress=False)
    async with Embedded(settings) as cluster, stagetree.connect(cluster.target, token=cluster.token) as client:
        study = await stagetree.Study.create(
            client, "forms", trainer="stagetree.nodemanager.examples.digits:DigitsMLP", tuned=["lr"],
            values={"hidden": 8, "minibatches": 1},
        )
        await study.eval({"lr": SEQ}, 6)
        loaded = await stagetree.Study.load(client, "forms")
        forms["sdk_loaded"] = repr((await loaded.best("accuracy")).config["lr"])
        def cli_best():  # blocking HTTP: off the loop that serves it
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                cli.main(["study", "best", study.id, "--metric", "accuracy", "--url", cluster.http_url,
                          "--token", cluster.token])
            return out.getvalue()

        forms["cli"] = re.search(r"config +lr=(.*)", await asyncio.to_thread(cli_best)).group(1).strip()
        req = urllib.request.Request(f"{cluster.http_url}/api/v1/studies/{study.id}/plan",
                                     headers={"Authorization": f"Bearer {cluster.token}"})
        plan = json.loads(await asyncio.to_thread(lambda: urllib.request.urlopen(req).read()))
        rest = plan["nodes"][-1]["config"]["lr"]
        # REST's JSON is the same form when it is the family JSON of the text the SDK prints
        forms["rest"] = repr(SEQ) if rest == to_family_json(SEQ) else json.dumps(rest)
        exported = export_to_optuna(await study_trials(loaded), study_name="forms", metric="accuracy")
        forms["export"] = str(exported.trials[0].params["lr"])
    print("FORMS " + json.dumps(forms))

asyncio.run(main())
"""

TUNER_AND_SPACE_CLASSES = [
    ("stagetree", n)
    for n in (
        "GridTuner", "RandomTuner", "SHA", "ASHA", "Hyperband", "MedianStopping", "PBT", "EarlyStopTuner",
        "GridSearchSpace", "RandomSearchSpace", "Choice", "Uniform", "LogUniform", "IntUniform", "Family",
    )
] + [("stagetree.integrations.optuna", "OptunaTuner"), ("stagetree.integrations.optuna", "OptunaSpace")]  # fmt: skip


def undocumented() -> list[str]:
    import importlib

    page = (ROOT / "docs" / "tuners.md").read_text()
    missing = []
    for module, name in TUNER_AND_SPACE_CLASSES:
        cls = getattr(importlib.import_module(module), name)
        if not (cls.__doc__ or "").strip() or not re.search(rf"`{name}\b", page):
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.first_hour", description=__doc__.splitlines()[0])
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    ns = p.parse_args(argv)
    py = sys.executable
    work = Path(tempfile.mkdtemp(prefix="first-hour-"))
    t_start = time.monotonic()
    try:
        code = quickstart_code()
        (work / "quickstart.py").write_text(code)
        shown, status, first_result_s = run_in_pty([py, "quickstart.py"], work, until="best accuracy ")
        assert status == 0, shown[-3000:]
        progress_shown = bool(re.search(r"quickstart: trials: .*\|.*best accuracy", shown))
        (work / "optuna_plain.py").write_text(OPTUNA_PLAIN)
        plain, status, optuna_first_s = run_in_pty([py, "optuna_plain.py"], work, until="first trial done")
        assert status == 0, plain[-3000:]
        print(
            f"quickstart: first result after {first_result_s:.1f} s; plain Optuna: first trial {optuna_first_s:.1f} s"
        )

        assert EDIT[0] in code, "the README's quickstart model changed; update EDIT"
        (work / "quickstart.py").write_text(code.replace(*EDIT))
        again, status, _ = run_in_pty([py, "quickstart.py"], work)
        assert status == 0, again[-3000:]
        (work / "list_trials.py").write_text(LIST_TRIALS)
        by_version = json.loads(run([py, "list_trials.py"], work).strip().splitlines()[-1])
        stale = not (len(by_version) == 2 and all(n >= 4 for n in by_version.values()))
        print(f"after the edit: trials by code version {by_version}")

        (work / "failing.py").write_text(FAILING)
        failing, status, _ = run_in_pty([py, "failing.py"], work)
        assert status == 0, failing[-3000:]
        m = re.search(r"FAILED_TRIALS \[([\d, ]*)\]", failing)
        assert m is not None, failing[-3000:]
        failed = [int(x) for x in m.group(1).split(",") if x.strip()]
        text = failing.replace("\r", "")
        printed = 0
        for t in failed:
            blocks = re.findall(rf"✗ trial {t} failed .*?(?=\n\S|\Z)", text, re.S)
            if len(blocks) == 1 and "ValueError" in blocks[0] and "worker log:" in blocks[0]:
                printed += 1
        print(f"failing trainer: trials {failed} failed, {printed} printed once with traceback and log")

        (work / "forms.py").write_text(FORMS)
        forms = json.loads(run([py, "forms.py"], work).split("FORMS ", 1)[1].splitlines()[0])
        print(f"one schedule's printed forms: {json.dumps(forms)}")
        missing = undocumented()
        if missing:
            print(f"undocumented tuner/space classes: {missing}")
    finally:
        if ns.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    print(f"optuna_first_trial_s={optuna_first_s:.2f} (a plain Optuna script on the same data, same run)")
    line = (
        f"stale_after_edit_loaded={str(stale).lower()} progress_shown={str(progress_shown).lower()} "
        f"failures_printed={printed} of {len(failed)} schedule_forms={len(set(forms.values()))} "
        f"undocumented_public={len(missing)} first_result_s={first_result_s:.2f}"
    )
    extra: dict[str, Any] = {
        "failed_trials": len(failed),
        "trials_by_code_version": by_version,
        "forms": forms,
        "undocumented": missing,
        "optuna_first_trial_s": round(optuna_first_s, 2),
        "bench_s": round(time.monotonic() - t_start, 1),
    }
    print(record("first_hour", line, extra=extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
