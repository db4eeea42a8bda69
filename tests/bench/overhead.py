"""Where the platform's own CPU goes on a user's study: the ported Optuna search of ``tests.bench.vs_optuna``
with nothing shared, its parts measured inside the processes that spend them.

    python -m tests.bench.overhead [--pairs 3] [--baseline REF] [--grid 0] [--trials 40]

Each run is a child process running ``userstyle/stagetree_study.py``'s study in embedded mode, as a user's
script does (``tabular_port`` imports optuna, scikit-learn, scipy and torch), with probes around the
platform's parts (``Probes``): wrappers that add up the CPU-seconds of the calling thread, or of the
worker process. The workers are forks of the script (the embedded default), so they carry the probes.
Per run:

* ``start_cpu_s``: the embedded cluster's start in the script's process (its imports of the master's
  and aggregator's modules, the database, the node manager's registration);
* ``run_cpu_s``: the script's process from that start to the study's end: the master (rounds, the API's
  calls), the aggregator, the node manager, the client and the tuner (TPE, which Optuna's process
  pays too);
* ``rounds`` and ``round_cpu_ms``: the scheduling rounds and the mean CPU of one (its thread's);
* ``worker_overhead_s``: the workers' CPU beyond the trainer's ``train`` and ``evaluate`` (batch start,
  snapshots, checkpoints, events), and ``worker_ms_per_batch``, the same per batch;
* ``platform_cpu_s``: start + run + worker overhead: what the platform adds to the user's imports and
  training (``tests.bench.vs_optuna``'s ``overhead_cpu_s_no_sharing`` measures the same from outside,
  against Optuna's price of a step).

The figures of a side are medians over its ``--pairs`` runs. With ``--baseline REF`` the same runs are
made with ``REF``'s ``stagetree`` (``tests.bench.baseline``), alternating with this tree's (ABAB), so a
change is measured against the code before it in one run of this VM, whose speed moves 20-40% by the
hour. The ``*_baseline`` figures are the baseline's and ``platform_vs_baseline`` is this tree's
``platform_cpu_s`` over the baseline's.

Last line: ``platform_cpu_s=<s> start_cpu_s=<s> run_cpu_s=<s> worker_overhead_s=<s>
worker_ms_per_batch=<ms> rounds=<n> round_cpu_ms=<ms> batches=<n>`` and, with ``--baseline``,
``platform_cpu_s_baseline=<s> run_cpu_s_baseline=<s> worker_overhead_s_baseline=<s>
round_cpu_ms_baseline=<ms> platform_vs_baseline=<r> baseline=<ref>``; kept in
``tests/bench/results/overhead.json`` (``tests.bench.record``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import glob
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.bench.baseline import ROOT, baseline_tree, child_env, git, installed_bytecode
from tests.bench.record import record

USERSTYLE = Path(__file__).resolve().parent / "userstyle"
FIGURES = (
    "platform_cpu_s", "start_cpu_s", "run_cpu_s", "worker_overhead_s", "worker_ms_per_batch", "rounds", "round_cpu_ms",
    "batches",
)  # fmt: skip
COMPARED = ("platform_cpu_s", "run_cpu_s", "worker_overhead_s", "round_cpu_ms")


class Probes:
    """CPU-seconds of the platform's parts, added up by wrappers installed on their functions (in the
    script's process, and in the workers forked from it). ``worker_dir``: where each worker writes its
    sums after each batch (``worker-<pid>.json``): a forked worker ends without running ``atexit``."""

    def __init__(self, worker_dir: Path) -> None:
        self.worker_dir = worker_dir
        self.marks: dict[str, float] = {}
        self.rounds = 0
        self.round_cpu_s = 0.0
        self.threads: dict[str, float] = {}
        self._worker = {"batches": 0, "train_s": 0.0, "eval_s": 0.0}

    def mark(self, name: str) -> None:
        self.marks[name] = time.process_time()

    def install(self) -> None:
        import stagetree.embedded as embedded
        from stagetree.master.scheduling import SchedulingLoop
        from stagetree.nodemanager.runtime.executor import BatchRun
        from stagetree.nodemanager.runtime.torch_trainer import TorchTrainer

        start, stop = embedded.Embedded.start, embedded.Embedded.__aexit__

        async def timed_start(cluster: Any) -> Any:
            self.mark("start")
            out = await start(cluster)
            self.mark("started")
            if cluster.worker_fork != "script":  # a fresh fork server's workers would carry no probes
                raise SystemExit(f"the workers' fork server is {cluster.worker_fork!r}, not a fork of the script")
            return out

        async def timed_stop(cluster: Any, *exc: Any) -> Any:
            self.mark("stopping")
            self.threads = thread_cpu()
            return await stop(cluster, *exc)

        embedded.Embedded.start = timed_start  # type: ignore[method-assign,assignment]
        embedded.Embedded.__aexit__ = timed_stop  # type: ignore[method-assign,assignment]
        SchedulingLoop.run_round = self._counted(SchedulingLoop.run_round)  # type: ignore[method-assign]
        TorchTrainer.train = self._summed(TorchTrainer.train, "train_s")  # type: ignore[method-assign]
        TorchTrainer.evaluate = self._summed(TorchTrainer.evaluate, "eval_s")  # type: ignore[method-assign]
        BatchRun.run = self._reported(BatchRun.run)  # type: ignore[method-assign]

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.rounds += 1
                self.round_cpu_s += time.thread_time() - t0

        return wrapper

    def _summed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()  # the batch's thread: a checkpoint written meanwhile is overhead
            try:
                return fn(*args, **kwargs)
            finally:
                self._worker[key] += time.thread_time() - t0

        return wrapper

    def _reported(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                self._worker["batches"] += 1
                # a fork's times start at zero
                sums = {**self._worker, "cpu_s": time.process_time(), "threads": thread_cpu()}
                (self.worker_dir / f"worker-{os.getpid()}.json").write_text(json.dumps(sums))

        return wrapper

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's sums after its last batch."""
        return [json.loads(Path(p).read_text()) for p in sorted(glob.glob(str(self.worker_dir / "worker-*.json")))]

    def figures(self) -> dict[str, float]:
        workers = self.workers()
        batches = sum(w["batches"] for w in workers)
        worker_overhead = sum(w["cpu_s"] - w["train_s"] - w["eval_s"] for w in workers)
        start = self.marks["started"] - self.marks["start"]
        run = self.marks["stopping"] - self.marks["started"]
        return {
            "platform_cpu_s": start + run + worker_overhead,
            "start_cpu_s": start,
            "run_cpu_s": run,
            "worker_overhead_s": worker_overhead,
            "worker_ms_per_batch": 1000 * worker_overhead / max(1, batches),
            "rounds": self.rounds,
            "round_cpu_ms": 1000 * self.round_cpu_s / max(1, self.rounds),
            "batches": batches,
        }


def thread_cpu() -> dict[str, float]:
    """CPU-seconds of each live thread of this process, by its Python name (its kernel name if it has
    none: gRPC's own threads), summed over threads of the same name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue  # ended meanwhile
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(tid), comm).rstrip("_0123456789") or comm
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def child(ns: argparse.Namespace) -> None:
    """One run with whatever ``stagetree`` this process imports; the last line is JSON: the figures, the
    file the scheduling loop came from and the script process's threads' CPU at the study's end."""
    sys.path.insert(0, str(USERSTYLE))
    study_script = importlib.import_module("stagetree_study")  # the user's script: torch, optuna, the port...

    import stagetree.master.scheduling as scheduling

    with tempfile.TemporaryDirectory(prefix="stagetree-overhead-") as tmp:
        probes = Probes(Path(tmp))
        probes.install()
        study = argparse.Namespace(
            trials=ns.trials,
            seed=0,
            workers=1,
            grid=ns.grid,
            home=Path(tmp) / "home",
            fresh_fork_server=False,
            replay=None,
        )
        import optuna
        import torch

        torch.set_num_threads(1)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        result = asyncio.run(study_script.run(study))
        figures, workers = probes.figures(), probes.workers()
    out = {
        "figures": figures,
        "merge_rate": result["merge_rate"],
        "code": os.path.realpath(scheduling.__file__),
        "threads": _rounded(probes.threads),
        "worker_threads": [_rounded(w["threads"]) for w in workers],
        "workers": [{k: round(w[k], 2) for k in ("batches", "cpu_s", "train_s", "eval_s")} for w in workers],
    }
    print(json.dumps(out), flush=True)


def _rounded(cpu: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])}


def run_child(ns: argparse.Namespace, python_path: str, tree: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tests.bench.overhead", "--child", "--grid", str(ns.grid), "--trials", str(ns.trials)]
    env = child_env(python_path)
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise SystemExit(f"the run failed ({out.returncode}):\n{out.stderr[-4000:]}")
    run: dict[str, Any] = json.loads(lines[-1])
    if not run["code"].startswith(str(tree.resolve()) + os.sep):
        raise SystemExit(f"the run imported {run['code']}, not the code of {tree}")
    return run


def medians(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in FIGURES}


def line_of(current: Mapping[str, float], baseline: Mapping[str, float] | None, ref: str) -> str:
    """The last line: this tree's figures, then the baseline's where there is one."""
    words = [f"{k}={current[k]:.0f}" if k in ("rounds", "batches") else f"{k}={current[k]:.2f}" for k in FIGURES]
    if baseline is not None:
        words += [f"{k}_baseline={baseline[k]:.2f}" for k in COMPARED]
        words += [f"platform_vs_baseline={current['platform_cpu_s'] / baseline['platform_cpu_s']:.3f}"]
        words += [f"baseline={ref}"]
    return " ".join(words)


@contextmanager
def trees(ref: str) -> Iterator[dict[str, tuple[str, Path]]]:
    """The trees to run: this one, and ``ref``'s when given (python path, root), each with its bytecode
    written, as an installed package has it."""
    installed_bytecode()
    if not ref:
        yield {"current": ("", ROOT)}
        return
    with baseline_tree(ref, compile_bytecode=True) as base:
        print(f"side by side: current {git('rev-parse', '--short', 'HEAD')} against {ref} ({base.commit[:7]})")
        yield {"current": ("", ROOT), "baseline": (base.python_path, base.tree)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="runs of each tree")
    parser.add_argument("--baseline", metavar="REF", default="", help="measure this commit's code too, alternately")
    parser.add_argument("--grid", type=int, default=0, help="points per float (0: continuous, nothing shared)")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        child(ns)
        return
    runs: dict[str, list[dict[str, float]]] = {}
    with trees(ns.baseline) as sides:
        for i in range(ns.pairs):
            for side in sides if i % 2 == 0 else reversed(list(sides)):
                python_path, tree = sides[side]
                run = run_child(ns, python_path, tree)
                runs.setdefault(side, []).append(run["figures"])
                shown = " ".join(f"{k}={v:.2f}" for k, v in run["figures"].items())
                print(f"{side:8s} {shown} merge_rate={run['merge_rate']:.2f} threads={run['threads']}", flush=True)
                print(f"{'':8s} workers={run['workers']} their threads={run['worker_threads']}", flush=True)
    current = medians(runs["current"])
    baseline = medians(runs["baseline"]) if "baseline" in runs else None
    command = f"python -m tests.bench.overhead --pairs {ns.pairs}" + (
        f" --baseline {ns.baseline}" if ns.baseline else ""
    )
    print(record("overhead", line_of(current, baseline, ns.baseline), command=command))


if __name__ == "__main__":
    main()
