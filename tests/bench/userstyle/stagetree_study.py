"""``tabular_mlp``'s search ported to stagetree (``tabular_port``), in embedded mode, as a user runs it.

    python stagetree_study.py OUT.json [--trials 40] [--seed 0] [--workers 1] [--grid 4] [--home DIR]
                                       [--fresh-fork-server] [--replay RUN.json]

The same TPE sampler and median pruner through ``OptunaTuner(promotions="pruner")``, rungs 3/9/27,
``--workers`` CPU slots with one torch thread each and as many trials in flight (docs/integrations.md:
``max_concurrent`` is the number of slots; Optuna's process runs one trial at a time, and with two in
flight on one slot the pruner, which waits for five complete trials, lets more trials run on: 540 steps
against 396 in one measurement); ``--grid 0``: continuous floats (nothing shared).
``--replay RUN.json``: in place of a new search, the trials ``optuna_study.py`` recorded in its RUN.json,
in its order, each pruned where it was (``replay``), with continuous floats: the same trials trained to
the same steps as that run. Writes the best accuracy, the study's sharing stats and when the first result
came (``time.time()``) to OUT.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import torch
from replay import ReplayPruner, port_params
from tabular_mlp import RUNGS
from tabular_port import space

import stagetree
from stagetree.client.tuners.base import Result
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.integrations.optuna import OptunaTuner


async def run(ns: argparse.Namespace) -> dict[str, Any]:
    first: list[float] = []

    def on_event(event: Any, actions: Any) -> None:
        if not first and isinstance(event, Result):
            first.append(time.time())

    settings = EmbeddedSettings(
        home=ns.home, workers=ns.workers, threads_per_worker=1, fork_workers_from_script=not ns.fresh_fork_server
    )
    replayed = json.loads(ns.replay.read_text())["replay"] if ns.replay else None
    pruner: optuna.pruners.BasePruner = optuna.pruners.MedianPruner(n_startup_trials=5)
    if replayed is not None:
        pruner = ReplayPruner([t["steps"] for t in replayed])
    async with Embedded(settings) as cluster, stagetree.connect(cluster.target, token=cluster.token) as client:
        study = await stagetree.Study.create(
            client, "tabular", trainer="tabular_port:Net", tuned=["lr", "bs", "momentum"], seed=ns.seed
        )
        tuner = OptunaTuner(
            space(None if replayed else ns.grid or None), optuna.samplers.TPESampler(seed=ns.seed),
            metric="accuracy", mode="max", n_trials=ns.trials if replayed is None else len(replayed),
            min_step=RUNGS[0], max_step=RUNGS[-1], eta=3, promotions="pruner", pruner=pruner,
            max_concurrent=ns.workers,
        )  # fmt: skip
        for t in replayed or ():
            tuner.study.enqueue_trial(port_params(t["params"]))
        await stagetree.drive(study, tuner, on_event=on_event)
        stats = await study.stats()
    if replayed is not None:  # the same trials, or the comparison is not at equal work
        ran = [t.params for t in sorted(tuner.study.trials, key=lambda t: t.number)]
        wanted = [port_params(t["params"]) for t in replayed]
        if ran != wanted:
            raise SystemExit(f"the replay ran other trials than it was given: {ran} != {wanted}")
    done = [t.value for t in tuner.study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
    return {
        "best": max(done, default=0.0),
        "trials": len(tuner.trials),
        "first_result_at": first[0] if first else None,
        "merge_rate": stats.merge_rate,
        "steps_executed": stats.steps_executed,
        "unique_steps": stats.unique_steps,
        "trial_by_trial_steps": stats.trial_by_trial_steps,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--grid", type=int, default=4, help="points per float (0: continuous, nothing shared)")
    p.add_argument("--home", type=Path, default=Path(".stagetree-tabular"))
    p.add_argument("--fresh-fork-server", action="store_true", help="never fork the workers' server from here")
    p.add_argument("--replay", type=Path, help="optuna_study.py's OUT.json: its trials, in place of a search")
    ns = p.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ns.out.write_text(json.dumps(asyncio.run(run(ns))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
