"""Plain Optuna side by side with its port to stagetree, every process of each counted from launch to exit.

    pip install ".[bench]"        # optuna, scikit-learn, scipy
    python -m tests.bench.vs_optuna [--trials 40] [--workers 1] [--minibatches 40] [--runs 1] [--fork-compare]

The workload is a user's module (``tests/bench/userstyle/``): ``tabular_mlp`` is an Optuna user's
``pytorch_simple``-style script (an MLP on generated tabular data, SGD with a tuned warmup-then-decay
learning rate, momentum and a batch-size ramp; TPE with a median pruner; accuracy reported at steps
3, 9 and 27); it imports optuna, scikit-learn and scipy as such modules do. ``tabular_port`` is its port
as docs/integrations.md tells an Optuna user to write it (a ``TorchTrainer`` and an ``OptunaSpace`` with
``grid=4``), driven by ``stagetree_study.py`` in embedded mode through ``OptunaTuner(promotions="pruner")``.
Four runs, each its own process tree launched by this bench (``tests.bench.proctree``: a subreaper
wrapper, so daemons and workers that outlive their parents are counted too), one torch thread per
training process, ``--workers`` processes (Optuna) or slots (stagetree) each. Stagetree's bytecode is
written first (``tests.bench.baseline.installed_bytecode``), as a pip install has it and Optuna's has:

1. ``optuna``: ``optuna_study.py``, one process (or ``--workers`` sharing an SQLite study);
2. ``stagetree``: the port, embedded (master, node manager, fork server and workers all counted);
3. ``optuna_replay`` and 4. ``stagetree_replay``: Optuna's search of run 1 played again by each system
   (``userstyle/replay.py``: its trials' parameters in its order, each pruned at the step it was pruned,
   continuous floats, so nothing is shared: merge rate 1.0). Both train the same trials to the same steps
   at the same batch sizes and neither sampler proposes anything, so what stagetree spends over Optuna
   there is the platform's overhead alone. (Two independent searches train different numbers of steps:
   the user's objective seeds no torch generator, so Optuna's trials, its pruner's calls and what TPE asks
   next differ run to run: 378 to 564 steps in the runs measured.)

Figures (Optuna's over stagetree's for the ratios; medians over ``--runs``, the order rotating):

* ``cpu_s_ratio``: CPU-seconds of the whole tree, start-up included;
* ``cpu_s_ratio_no_sharing``: ``optuna_replay``'s over ``stagetree_replay``'s (the steps stagetree trained
  beyond or short of Optuna's, should a batch be retried, each at Optuna's CPU-seconds a step);
  ``replay_steps``, the steps each replay trained;
* ``e2e_ratio``: wall seconds from launch to the last process's exit;
* ``merge_rate``: the study's trial-by-trial steps over its unique steps (``study.stats()``);
* ``first_trial_s``: from stagetree's launch to its first result;
* ``steps_trained_twice``: steps stagetree's batches trained beyond the unique steps (the sharing run);
* ``optuna_first_trial_s``: Optuna's first result from its launch (both sides pay the script's imports);
* ``cpu_s_per_step_ratio``: the CPU-seconds of a trained step, everything counted (Optuna's over
  stagetree's sharing run): over 1.0, a step costs stagetree less than Optuna, its overhead included;
* with ``--fork-compare``, ``cpu_s_fork_from_script_vs_fresh``: the sharing run with the workers' fork
  server a fresh interpreter over the default (a fork of the script: ``EmbeddedSettings``).

Where stagetree's CPU goes, from one more process tree each run: ``imports``, a process that imports what
any process running the user's module must (``tabular_mlp``'s optuna, scikit-learn, scipy and torch, and
``torch._dynamo``, which the first ``optimizer.step`` imports): ``fixed_cpu_s``, paid once by both sides.
Its wall time, ``fixed_wall_s``, is how soon any process running the module can train a step: a
``first_trial_s`` below it is not possible. Optuna's CPU-seconds of a trained step are then
``(optuna - fixed) / optuna's steps``, and

* ``overhead_cpu_s``: stagetree's CPU beyond ``fixed`` and its executed steps at Optuna's price: the
  platform (its imports and start, the master, node manager and aggregator, checkpoints, the workers' own
  start); ``overhead_cpu_s_no_sharing``: ``stagetree_replay``'s CPU beyond ``optuna_replay``'s, measured
  rather than priced;
* ``cpu_s_ratio_bound``: the ``cpu_s_ratio`` stagetree would reach with no overhead at all
  (``optuna / (fixed + executed steps at Optuna's price)``). Where it is below ``0.9 x merge_rate`` that
  target cannot be met on the workload: the fixed cost both sides pay, and Optuna's pruner training fewer
  trial-by-trial steps than stagetree's, bound the ratio.

Last line: ``optuna_best=<a> stagetree_best=<a> merge_rate=<m> cpu_s_ratio=<r> e2e_ratio=<r>
cpu_s_ratio_no_sharing=<r> first_trial_s=<s> steps_trained_twice=<n> optuna_first_trial_s=<s>
cpu_s_per_step_ratio=<r> cpu_s_ratio_bound=<r> fixed_cpu_s=<s> fixed_wall_s=<s> overhead_cpu_s=<s>
overhead_cpu_s_no_sharing=<s> replay_steps=<n>``, kept with every run's figures in
``tests/bench/results/vs_optuna.json`` (``tests.bench.record``). Targets: stagetree_best >= optuna_best - 0.005,
cpu_s_ratio >= 0.9 x merge_rate, cpu_s_ratio_no_sharing >= 0.9, e2e_ratio >= 1.0, first_trial_s <= 5,
steps_trained_twice == 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.bench.baseline import installed_bytecode
from tests.bench.proctree import TreeUsage, run_counted, summary
from tests.bench.record import record

USERSTYLE = Path(__file__).resolve().parent / "userstyle"
TIMEOUT_S = 3600.0
SIDES = ("optuna", "stagetree", "optuna_replay", "stagetree_replay")  # the replays play optuna's run again
FRESH = "stagetree_fresh_fork_server"  # --fork-compare: the sharing run with a fork server of its own


def side_command(side: str, out: Path, ns: argparse.Namespace, home: Path) -> list[str]:
    common = [str(out), "--trials", str(ns.trials), "--seed", str(ns.seed), "--workers", str(ns.workers)]
    replay = ["--replay", str(out.parent / "optuna.json")] if side.endswith("_replay") else []
    if side.startswith("optuna"):
        return [sys.executable, str(USERSTYLE / "optuna_study.py"), *common, *replay]
    fresh = ["--fresh-fork-server"] if side == FRESH else []
    grid = ["--grid", str(ns.grid)]
    return [sys.executable, str(USERSTYLE / "stagetree_study.py"), *common, *grid, "--home", str(home), *fresh, *replay]


def run_side(side: str, ns: argparse.Namespace, work: Path) -> tuple[TreeUsage, dict[str, Any]]:
    out = work / f"{side}.json"
    env = {**os.environ, "TABULAR_MINIBATCHES": str(ns.minibatches), "OMP_NUM_THREADS": "1"}
    usage = run_counted(side_command(side, out, ns, work / f"home-{side}"), env=env, cwd=USERSTYLE, timeout_s=TIMEOUT_S)
    if usage.rc != 0:
        raise RuntimeError(f"{side} exited {usage.rc}")
    return usage, json.loads(out.read_text())


IMPORTS = "imports"  # the fixed cost: what any process running the user's module imports


def run_imports(ns: argparse.Namespace) -> TreeUsage:
    """CPU of a process that only imports the user's module and what its first optimizer step imports."""
    env = {**os.environ, "TABULAR_MINIBATCHES": str(ns.minibatches), "OMP_NUM_THREADS": "1"}
    code = "import optuna, torch, tabular_mlp, torch._dynamo"
    usage = run_counted([sys.executable, "-c", code], env=env, cwd=USERSTYLE, timeout_s=600)
    if usage.rc != 0:
        raise RuntimeError(f"the imports probe exited {usage.rc}")
    return usage


def overhead(runs: dict[str, list[tuple[TreeUsage, dict[str, Any]]]], fixed: list[TreeUsage]) -> dict[str, float]:
    """Stagetree's CPU beyond the fixed cost and its steps at Optuna's price, and the ratio's bound (medians
    over runs, each run's sides against the same run's imports probe)."""
    med = statistics.median
    bound, over, over_ns, ns_ratio, replayed = [], [], [], [], []
    for i, f in enumerate(fixed):
        (opt, o_out), (st, s_out), (opt_r, or_out), (st_r, sr_out) = (runs[s][i] for s in SIDES)
        step = (opt.cpu_s - f.cpu_s) / o_out["steps"]
        bound.append(opt.cpu_s / (f.cpu_s + step * s_out["steps_executed"]))
        over.append(st.cpu_s - f.cpu_s - step * s_out["steps_executed"])
        # the replays train the same steps; any stagetree trained beyond or short of Optuna's at its price
        st_r_cpu = st_r.cpu_s + (opt_r.cpu_s - f.cpu_s) / or_out["steps"] * (or_out["steps"] - sr_out["steps_executed"])
        over_ns.append(st_r_cpu - opt_r.cpu_s)
        ns_ratio.append(opt_r.cpu_s / st_r_cpu)
        replayed.append(or_out["steps"])
    return {
        "fixed_cpu_s": float(med(f.cpu_s for f in fixed)),
        "fixed_wall_s": float(med(f.wall_s for f in fixed)),
        "overhead_cpu_s": float(med(over)),
        "overhead_cpu_s_no_sharing": float(med(over_ns)),
        "cpu_s_ratio_bound": float(med(bound)),
        "cpu_s_ratio_no_sharing": float(med(ns_ratio)),
        "replay_steps": float(med(replayed)),
    }


def figures(runs: dict[str, list[tuple[TreeUsage, dict[str, Any]]]]) -> dict[str, float]:
    """The last line's figures from each side's runs (medians)."""
    med = statistics.median

    def cpu(side: str) -> float:
        return float(med(u.cpu_s for u, _ in runs[side]))

    def wall(side: str) -> float:
        return float(med(u.wall_s for u, _ in runs[side]))

    def per_step(side: str, steps: str) -> float:
        return float(med(u.cpu_s / o[steps] for u, o in runs[side]))

    st = runs["stagetree"]
    first = [o["first_result_at"] - u.t_launch for u, o in st if o.get("first_result_at")]
    optuna_first = [o["first_result_at"] - u.t_launch for u, o in runs["optuna"] if o.get("first_result_at")]
    extra = {"cpu_s_fork_from_script_vs_fresh": cpu(FRESH) / cpu("stagetree")} if runs.get(FRESH) else {}
    return {
        "optuna_best": float(med(o["best"] for _, o in runs["optuna"])),
        "stagetree_best": float(med(o["best"] for _, o in st)),
        "merge_rate": float(med(o["merge_rate"] for _, o in st)),
        "cpu_s_ratio": cpu("optuna") / cpu("stagetree"),
        "e2e_ratio": wall("optuna") / wall("stagetree"),
        "first_trial_s": float(med(first)) if first else float("nan"),
        "steps_trained_twice": float(med(o["steps_executed"] - o["unique_steps"] for _, o in st)),
        # beside the targets: Optuna's first result from its launch (both pay the script's imports), and
        # the CPU-seconds of a trained step, every process and the start-up included (Optuna's over ours)
        "optuna_first_trial_s": float(med(optuna_first)) if optuna_first else float("nan"),
        "cpu_s_per_step_ratio": per_step("optuna", "steps") / per_step("stagetree", "steps_executed"),
        **extra,
    }


def last_line(f: dict[str, float]) -> str:
    return (
        f"optuna_best={f['optuna_best']:.4f} stagetree_best={f['stagetree_best']:.4f} "
        f"merge_rate={f['merge_rate']:.2f} cpu_s_ratio={f['cpu_s_ratio']:.2f} e2e_ratio={f['e2e_ratio']:.2f} "
        f"cpu_s_ratio_no_sharing={f['cpu_s_ratio_no_sharing']:.2f} first_trial_s={f['first_trial_s']:.1f} "
        f"steps_trained_twice={f['steps_trained_twice']:.0f} optuna_first_trial_s={f['optuna_first_trial_s']:.1f} "
        f"cpu_s_per_step_ratio={f['cpu_s_per_step_ratio']:.2f} cpu_s_ratio_bound={f['cpu_s_ratio_bound']:.2f} "
        f"fixed_cpu_s={f['fixed_cpu_s']:.1f} fixed_wall_s={f['fixed_wall_s']:.1f} "
        f"overhead_cpu_s={f['overhead_cpu_s']:.1f} overhead_cpu_s_no_sharing={f['overhead_cpu_s_no_sharing']:.1f} "
        f"replay_steps={f['replay_steps']:.0f}"
        + (
            f" cpu_s_fork_from_script_vs_fresh={f['cpu_s_fork_from_script_vs_fresh']:.2f}"
            if "cpu_s_fork_from_script_vs_fresh" in f
            else ""
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.vs_optuna", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="Optuna processes = stagetree slots")
    p.add_argument("--grid", type=int, default=4, help="points per float in the sharing run")
    p.add_argument("--minibatches", type=int, default=40, help="batches per step (the cost of a step)")
    p.add_argument("--runs", type=int, default=1, help="runs of each side, the order rotating; medians")
    p.add_argument(
        "--fork-compare", action="store_true", help=f"also {FRESH}: the workers' fork server a fresh interpreter"
    )
    ns = p.parse_args(argv)
    sides = (*SIDES, FRESH) if ns.fork_compare else SIDES
    installed_bytecode()  # as a pip install of stagetree has it (Optuna's has its own from pip)
    print(
        f"vs_optuna: {ns.trials} TPE trials + median pruner, tabular MLP ({ns.minibatches} minibatches/step, "
        f"rungs 3/9/27), {ns.workers} process(es)/slot(s) each, one torch thread, {ns.runs} run(s)",
        flush=True,
    )
    runs: dict[str, list[tuple[TreeUsage, dict[str, Any]]]] = {s: [] for s in sides}
    fixed: list[TreeUsage] = []
    for i in range(ns.runs):
        work = Path(tempfile.mkdtemp(prefix="vs-optuna-"))
        try:
            fixed.append(run_imports(ns))
            print(f"  {IMPORTS:22s} cpu_s {fixed[-1].cpu_s:7.1f}  (the user's module and torch._dynamo)", flush=True)
            rest = sides[1:]  # after optuna's search, which the replays play again; their order rotating
            for side in (sides[0], *rest[i % len(rest) :], *rest[: i % len(rest)]):
                usage, out = run_side(side, ns, work)
                runs[side].append((usage, out))
                extra = f"  steps {out['steps']}" if side.startswith("optuna") else ""
                if not side.startswith("optuna"):
                    extra = (
                        f"  merge {out['merge_rate']:.2f}  steps {out['steps_executed']} (unique "
                        f"{out['unique_steps']}, trial by trial {out['trial_by_trial_steps']})"
                    )
                print(
                    f"  {side:22s} best {out['best']:.4f}  cpu_s {usage.cpu_s:7.1f}  e2e {usage.wall_s:7.1f} s  "
                    f"procs {usage.peak_procs} at once ({summary(usage.names)}){extra}",
                    flush=True,
                )
        finally:
            shutil.rmtree(work, ignore_errors=True)
    f = {**figures(runs), **overhead(runs, fixed)}
    details = {
        "args": {k: v for k, v in vars(ns).items()},
        # each side's output but the replayed trials' parameters (forty per Optuna run)
        "runs": {
            side: [{"usage": vars(u), "out": {k: v for k, v in o.items() if k != "replay"}} for u, o in r]
            for side, r in runs.items()
        },
        "imports": [vars(u) for u in fixed],
    }
    print(record("vs_optuna", last_line(f), extra=details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
