"""A recorded Optuna search played again: its trials' parameters in its order, each stopped where it
stopped (``tests.bench.vs_optuna``'s no-sharing comparison).

Both sides of that comparison replay the same search, plain Optuna (``optuna_study.py --replay``) and
its port to stagetree (``stagetree_study.py --replay``), so both train the same trials to the same steps
at the same batch sizes, and what one spends over the other is the platform alone. The replayed trials
are enqueued (``study.enqueue_trial``), so the sampler proposes nothing on either side, and
``ReplayPruner`` prunes trial ``n`` at the step the recorded search pruned it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna
from tabular_mlp import RUNGS


def recorded(study: optuna.Study) -> list[dict[str, Any]]:
    """The finished trials of a search, in order: their parameters and the step each trained to."""
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return [
        {"params": dict(t.params), "steps": max(t.intermediate_values, default=0)}
        for t in sorted(study.trials, key=lambda t: t.number)
        if t.state in done
    ]


class ReplayPruner(optuna.pruners.BasePruner):
    """Prunes trial ``n`` once it reported step ``steps[n]``, unless that is the last rung."""

    def __init__(self, steps: Sequence[int]) -> None:
        self.steps = list(steps)

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        if step is None or trial.number >= len(self.steps):
            return False
        stop = self.steps[trial.number]
        return stop < RUNGS[-1] and step >= stop


def port_params(params: dict[str, Any]) -> dict[str, Any]:
    """``tabular_mlp``'s parameters as ``tabular_port.space``'s Optuna parameters: the same warmup to
    ``peak`` and decay family, the batch size doubled at step 15 where ``ramp``."""
    family = {"cosine": "Cosine", "exponential": "Exponential", "multistep": "MultiStep"}[params["decay"]]
    out: dict[str, Any] = {
        "bs": "MultiStep(64, [15], 2.0)" if params["ramp"] else "64",
        "lr.then": family,
        f"lr.then[{family}].init": params["peak"],
        "momentum": params["momentum"],
    }
    if family == "Exponential":
        out[f"lr.then[{family}].gamma"] = str(params["gamma"])
    if family == "MultiStep":
        out[f"lr.then[{family}].milestones"] = str([int(m) for m in params["milestones"].split(",")])
    return out
