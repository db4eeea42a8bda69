"""What a study costs the machine, every process counted: this tree against another commit's, side by side.

    python -m tests.bench.warm [--base REF] [--runs 2] [--trials 30] [--promote 10]

The study is a user's: the trainer module ``tests.bench.vs_optuna`` ports from an Optuna user's script
(``tests/bench/userstyle/tabular_port.py``, which imports optuna, scikit-learn and scipy through
``tabular_mlp``), run by a script that starts the embedded cluster (two CPU slots)
and evaluates ``--trials`` configurations (a constant learning rate each, no two alike, so nothing is
shared) to step 6, then continues the best ``--promote`` of them to step 12: some 40 short batches,
each a second of training or less, where a platform's per-batch overhead shows.

Each run starts the script as a child process of this one, which is the child subreaper
(``PR_SET_CHILD_SUBREAPER``), so every process the script's tree starts (the fork server, the
workers, what they fork) is reaped here once it ends, and its CPU time lands in this process's
``RUSAGE_CHILDREN``. Figures, per tree (``new``: this worktree; ``base``: ``--base``, checked out into a
temporary git worktree and put first on the child's ``PYTHONPATH``), median over ``--runs`` runs that
alternate which goes first:

* ``cpu_s``: CPU-seconds (user + system) of the whole process tree, start-up included;
* ``wall_s``: the script's wall-clock time, start to exit;
* ``first_result_s``: from the script's start to its first trial result;
* ``up_s``: from the script's start to the embedded cluster being up (``Embedded.__aenter__`` done).

With ``--no-dynamo`` this tree also runs with ``STAGETREE_NM_WORKER_PRELOAD`` empty (``new_nodynamo``):
what preloading ``torch._dynamo`` in the fork server buys (the first optimizer a trainer builds imports
it, so without the preload each worker imports it once).

Writes ``tests/bench/results/warm.json`` (``tests.bench.record``). Last line:
``cpu_s_new=<s> cpu_s_base=<s> cpu_ratio=<base/new> first_result_s_new=<s> first_result_s_base=<s> up_s_new=<s>``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tests.bench.baseline import ROOT, baseline_tree, child_env
from tests.bench.record import record

USER_MODULES = Path(__file__).resolve().parent / "userstyle"
PR_SET_CHILD_SUBREAPER = 36
NO_DYNAMO = "new_nodynamo"  # this tree without torch._dynamo preloaded in the fork server


# -- the user's script (run as a child) ----------------------------------------------------------------


async def _study(home: Path, trials: int, promote: int, started: float) -> dict[str, Any]:
    import stagetree
    from stagetree.embedded import Embedded, EmbeddedSettings

    lrs = [0.002 * 1.15**i for i in range(trials)]
    out: dict[str, Any] = {}
    settings = EmbeddedSettings(home=home, workers=2, user_path=(str(USER_MODULES),))
    async with Embedded(settings) as cluster:
        out["up_s"] = time.time() - started
        async with stagetree.connect(cluster.target, token=cluster.token) as client:
            study = await stagetree.Study.create(client, "warm-bench", trainer="tabular_port:Net", tuned=["lr"])
            first: list[float] = []

            async def one(lr: float, step: int) -> tuple[float, float]:
                metrics = await study.eval({"lr": lr}, step)
                if not first:
                    first.append(time.time() - started)
                return lr, metrics["accuracy"]

            scored = await asyncio.gather(*(one(lr, 6) for lr in lrs))
            best = sorted(scored, key=lambda p: -p[1])[:promote]
            final = await asyncio.gather(*(one(lr, 12) for lr, _ in best))
            stats = await study.stats()
    out.update(
        first_result_s=first[0],
        best=max(acc for _, acc in final),
        steps=stats.steps_executed,
        batches=len(scored) + len(final),
    )
    return out


def _child(args: argparse.Namespace) -> None:
    started = float(args.started)
    out = asyncio.run(_study(Path(args.home), args.trials, args.promote, started))
    print(json.dumps(out), flush=True)


# -- the parent: runs and counts -------------------------------------------------------------------------


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _reap_all(timeout_s: float = 60.0) -> None:
    """Wait for every process left of the tree (reparented here), so their CPU time is counted."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)
    raise TimeoutError("processes of the study's tree still running after it ended")


def _one_run(tree: str, python_path: str, trials: int, promote: int) -> dict[str, Any]:
    env = child_env(python_path)
    env.pop("STAGETREE_NM_WORKER_PRELOAD", None)
    if tree == NO_DYNAMO:
        env["STAGETREE_NM_WORKER_PRELOAD"] = ""  # the fork server imports the runtime and torch only
    with tempfile.TemporaryDirectory(prefix=f"warm-{tree}-") as home:
        cpu0 = _children_cpu()
        t0 = time.time()
        cmd = [sys.executable, "-m", "tests.bench.warm", "--child", "--home", home, "--started", repr(t0)]
        cmd += ["--trials", str(trials), "--promote", str(promote)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.time() - t0
        _reap_all()
        cpu = _children_cpu() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"{tree} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(cpu_s=cpu, wall_s=wall)
    print(f"  {tree}: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})}")
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="", help="the commit to compare with (default: none, this tree only)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--promote", type=int, default=10)
    p.add_argument(
        "--no-dynamo", action="store_true", help=f"also run this tree without the dynamo preload ({NO_DYNAMO})"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--home", default="", help=argparse.SUPPRESS)
    p.add_argument("--started", default="0", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return

    _become_subreaper()
    trees: dict[str, str] = {"new": ""}
    with ExitStack() as stack:
        if args.base:
            trees["base"] = stack.enter_context(baseline_tree(args.base)).python_path
        if args.no_dynamo:
            trees[NO_DYNAMO] = ""
        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
        for i in range(args.runs):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for tree in order:
                runs[tree].append(_one_run(tree, trees[tree], args.trials, args.promote))

    def med(tree: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in runs[tree])

    figures: dict[str, Any] = {"trials": args.trials, "promote": args.promote, "runs": args.runs, "base": args.base}
    for tree in trees:
        for key in ("cpu_s", "wall_s", "first_result_s", "up_s", "batches", "steps"):
            figures[f"{key}_{tree}"] = round(med(tree, key), 3)
    if "base" in trees:
        figures["cpu_ratio"] = round(figures["cpu_s_base"] / figures["cpu_s_new"], 3)
        figures["wall_ratio"] = round(figures["wall_s_base"] / figures["wall_s_new"], 3)
    line = [f"cpu_s_new={figures['cpu_s_new']}"]
    if "base" in trees:
        line += [f"cpu_s_base={figures['cpu_s_base']}", f"cpu_ratio={figures['cpu_ratio']}"]
    line.append(f"first_result_s_new={figures['first_result_s_new']}")
    if "base" in trees:
        line.append(f"first_result_s_base={figures['first_result_s_base']}")
    line.append(f"up_s_new={figures['up_s_new']}")
    if NO_DYNAMO in trees:
        line += [f"cpu_s_nodynamo={figures[f'cpu_s_{NO_DYNAMO}']}"]
        line += [f"first_result_s_nodynamo={figures[f'first_result_s_{NO_DYNAMO}']}"]
    print(record("warm", " ".join(line), extra={"summary": figures, "runs_raw": runs}))


if __name__ == "__main__":
    main()
