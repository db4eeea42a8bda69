"""``userstyle/replay.py``: a recorded Optuna search played again, on plain Optuna and through the port's
``OptunaSpace`` (tests.bench.vs_optuna's no-sharing comparison)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import optuna
import pytest

USERSTYLE = Path(__file__).resolve().parents[2] / "bench" / "userstyle"


@pytest.fixture(scope="module", autouse=True)
def _userstyle() -> Any:
    sys.path.insert(0, str(USERSTYLE))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield
    sys.path.remove(str(USERSTYLE))


SEARCH = [  # tabular_mlp's parameters, one per decay family and batch-size ramp, and where each stopped
    ({"peak": 0.05, "decay": "cosine", "momentum": 0.9, "ramp": False}, 27),
    ({"peak": 0.2, "decay": "exponential", "momentum": 0.85, "ramp": True, "gamma": 0.95}, 3),
    ({"peak": 0.011, "decay": "multistep", "momentum": 0.81, "ramp": True, "milestones": "15,25"}, 9),
    ({"peak": 0.3, "decay": "exponential", "momentum": 0.94, "ramp": False, "gamma": 0.9}, 27),
]


def _search(study: optuna.Study, trials: int) -> list[int]:
    """Trials that report at tabular_mlp's rungs until pruned, as its objective does; the steps reached."""
    from tabular_mlp import RUNGS

    reached = []

    def objective(trial: optuna.Trial) -> float:
        trial.suggest_float("x", 0.0, 1.0)
        for step in RUNGS:
            trial.report(float(step), step)
            if trial.should_prune():
                reached.append(step)
                raise optuna.TrialPruned()
        reached.append(RUNGS[-1])
        return 1.0

    study.optimize(objective, n_trials=trials)
    return reached


def test_the_replay_pruner_stops_each_trial_where_the_recorded_search_did() -> None:
    from replay import ReplayPruner, recorded

    steps = [s for _, s in SEARCH]
    study = optuna.create_study(direction="maximize", pruner=ReplayPruner(steps))
    for i in range(len(steps)):
        study.enqueue_trial({"x": i / 10})
    assert _search(study, len(steps)) == steps
    again = recorded(study)
    assert [t["steps"] for t in again] == steps
    assert [t["params"] for t in again] == [{"x": i / 10} for i in range(len(steps))]
    # a trial past the recording is never pruned
    assert _search(study, 1) == [27]


def test_the_ports_space_proposes_exactly_the_replayed_parameters() -> None:
    from replay import port_params
    from tabular_port import space

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
    for params, _ in SEARCH:
        study.enqueue_trial(port_params(params))
    for params, _ in SEARCH:
        trial = study.ask()
        config = space(None).suggest(trial)
        assert trial.params == port_params(params)  # the enqueued values, none sampled
        assert config["momentum"].values(0, 1) == [params["momentum"]]
        assert config["bs"].values(14, 16) == ([64, 128] if params["ramp"] else [64, 64])  # doubled at 15
        study.tell(trial, 1.0)
