"""Plain Optuna on ``tabular_mlp``: TPE with a median pruner, ``--trials`` trials, one torch thread.

    python optuna_study.py OUT.json [--trials 40] [--seed 0] [--workers 1] [--replay RUN.json]

With ``--workers N`` > 1, N processes share one study (Optuna's RDB storage on SQLite). Writes the best
accuracy, the steps trained, when the first trial reported (``time.time()``) and the trials (``replay``:
their parameters and steps) to OUT.json. ``--replay RUN.json``: the trials of an earlier run's OUT.json
again, in its order, each pruned where it was (``replay.ReplayPruner``), in place of a new search.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
import torch
from replay import ReplayPruner, recorded
from tabular_mlp import objective

first_report: list[float] = []


def _objective(trial: optuna.Trial) -> float:
    try:
        return objective(trial)
    finally:
        if not first_report and trial.number == 0:
            first_report.append(time.time())


def _pruner(replayed: list[dict[str, Any]] | None) -> optuna.pruners.BasePruner:
    if replayed is None:
        return optuna.pruners.MedianPruner(n_startup_trials=5)
    return ReplayPruner([t["steps"] for t in replayed])


def _study(storage: str | None, seed: int, replayed: list[dict[str, Any]] | None = None) -> optuna.Study:
    return optuna.create_study(
        study_name="tabular", storage=storage, load_if_exists=True, direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed), pruner=_pruner(replayed),
    )  # fmt: skip


def _worker(storage: str, seed: int, trials: int, replayed: list[dict[str, Any]] | None) -> None:
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _study(storage, seed, replayed).optimize(_objective, n_trials=trials)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--replay", type=Path, help="an earlier run's OUT.json: its trials again")
    ns = p.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    replayed = json.loads(ns.replay.read_text())["replay"] if ns.replay else None
    n_trials = ns.trials if replayed is None else len(replayed)
    with tempfile.TemporaryDirectory() as tmp:
        storage = None if ns.workers == 1 else f"sqlite:///{tmp}/optuna.db"
        study = _study(storage, ns.seed, replayed)
        for t in replayed or ():
            study.enqueue_trial(t["params"])
        if ns.workers == 1:
            study.optimize(_objective, n_trials=n_trials)
        else:
            assert storage is not None
            share = [n_trials // ns.workers + (i < n_trials % ns.workers) for i in range(ns.workers)]
            ctx = multiprocessing.get_context("spawn")
            procs = [ctx.Process(target=_worker, args=(storage, ns.seed + i, n, replayed)) for i, n in enumerate(share)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
        trials = study.trials
        replay = recorded(study)
    done = [t.value for t in trials if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
    ns.out.write_text(
        json.dumps(
            {
                "best": max(done, default=0.0),
                "trials": len(trials),
                "complete": len(done),
                "steps": sum(max(t.intermediate_values, default=0) for t in trials),
                "first_result_at": first_report[0] if first_report else None,
                "replay": replay,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
