"""Plain Optuna on ``tabular_mlp``: TPE with a median pruner, ``--trials`` trials, one torch thread.

    python optuna_study.py OUT.json [--trials 40] [--seed 0] [--workers 1]

With ``--workers N`` > 1, N processes share one study (Optuna's RDB storage on SQLite). Writes the best
accuracy, the steps trained and when the first trial reported (``time.time()``) to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import optuna
import torch
from tabular_mlp import objective

first_report: list[float] = []


def _objective(trial: optuna.Trial) -> float:
    try:
        return objective(trial)
    finally:
        if not first_report and trial.number == 0:
            first_report.append(time.time())


def _study(storage: str | None, seed: int) -> optuna.Study:
    return optuna.create_study(
        study_name="tabular", storage=storage, load_if_exists=True, direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed), pruner=optuna.pruners.MedianPruner(n_startup_trials=5),
    )  # fmt: skip


def _worker(storage: str, seed: int, trials: int) -> None:
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _study(storage, seed).optimize(_objective, n_trials=trials)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    ns = p.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        storage = None if ns.workers == 1 else f"sqlite:///{tmp}/optuna.db"
        study = _study(storage, ns.seed)
        if ns.workers == 1:
            study.optimize(_objective, n_trials=ns.trials)
        else:
            assert storage is not None
            share = [ns.trials // ns.workers + (i < ns.trials % ns.workers) for i in range(ns.workers)]
            ctx = multiprocessing.get_context("spawn")
            procs = [ctx.Process(target=_worker, args=(storage, ns.seed + i, n)) for i, n in enumerate(share)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
        trials = study.trials
    done = [t.value for t in trials if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
    ns.out.write_text(
        json.dumps(
            {
                "best": max(done, default=0.0),
                "trials": len(trials),
                "complete": len(done),
                "steps": sum(max(t.intermediate_values, default=0) for t in trials),
                "first_result_at": first_report[0] if first_report else None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
