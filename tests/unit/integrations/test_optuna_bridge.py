"""The Optuna bridge driven by the tuner simulator: samplers propose, rungs or pruners decide, Optuna
sees every report; and export to an Optuna storage that optuna's own readers load."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

optuna = pytest.importorskip("optuna")

from optuna.trial import TrialState  # noqa: E402

from stagetree.client.spaces import Choice, Family, IntUniform, LogUniform, Shared, TrialConfig, Uniform  # noqa: E402
from stagetree.client.tuners.base import Submit  # noqa: E402
from stagetree.client.tuners.simulate import simulate  # noqa: E402
from stagetree.core.errors import InvalidArgument  # noqa: E402
from stagetree.core.sequences import Cosine, Exponential, MultiStep, Warmup  # noqa: E402
from stagetree.integrations.optuna import OptunaSpace, OptunaTuner, export_to_optuna  # noqa: E402
from stagetree.integrations.records import TrialRecord, group_results  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)


def space(grid: int | None = 4) -> OptunaSpace:
    decay = Choice(
        [
            Family(Cosine, init=LogUniform(0.01, 0.3), min_value=0.001, period=80),
            Family(Exponential, init=LogUniform(0.01, 0.3), gamma=Choice([0.95, 0.99])),
            Family(MultiStep, init=LogUniform(0.01, 0.3), milestones=[40], gamma=0.3),
        ]
    )
    return OptunaSpace(
        {"lr": Family(Warmup, init=0.01, period=5, then=decay), "bs": Choice([32, MultiStep(32, [40], 2)]),
         "momentum": Uniform(0.5, 0.9), "layers": IntUniform(1, 3)},
        grid=grid,
    )  # fmt: skip


def curve(config: TrialConfig, step: int) -> dict[str, float]:
    """A learning curve whose end value prefers lr near 0.1 and momentum near 0.9."""
    lr = float(config["lr"].value(10))
    m = float(config["momentum"].value(0))
    best = 1.0 - abs(math.log(lr / 0.1)) / 5 - abs(m - 0.9)
    return {"acc": best * (1 - math.exp(-step / 20)), "loss": 1 - best + 10 / (step + 10)}


def test_space_suggests_sequences_and_grid_keeps_floats_on_k_points() -> None:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen_lr: set[float] = set()
    seen_m: set[float] = set()
    for _ in range(40):
        t = study.ask()
        cfg = space().suggest(t)
        assert isinstance(cfg["lr"], Warmup) and cfg["lr"].value(0) == 0.01
        seen_lr.add(float(cfg["lr"].then.init))  # type: ignore[attr-defined]
        seen_m.add(float(cfg["momentum"].value(0)))
        assert {n.split("[")[0] for n in t.params} >= {"lr.then", "bs", "momentum", "layers"}
    assert seen_lr <= {0.01, 0.03107, 0.09655, 0.3} and len(seen_lr) > 1  # 4 geometric points
    assert seen_m <= {0.5, 0.6333, 0.7667, 0.9} and len(seen_m) > 1
    with pytest.raises(InvalidArgument, match="ambiguous"):
        OptunaSpace({"lr": [0.1, 0.2]})


@pytest.mark.parametrize(
    ("sampler", "n"),
    [
        (lambda: optuna.samplers.TPESampler(seed=0, n_startup_trials=5), 27),
        (lambda: optuna.samplers.CmaEsSampler(seed=0, n_startup_trials=3), 27),
        (lambda: optuna.samplers.GPSampler(seed=0, n_startup_trials=4), 9),  # a GP fit per ask: fewer
        (lambda: optuna.samplers.RandomSampler(seed=0), 27),
    ],
    ids=["tpe", "cmaes", "gp", "random"],
)
def test_asha_promotions_with_any_sampler(sampler: Any, n: int) -> None:
    tuner = OptunaTuner(space(), sampler(), metric="acc", n_trials=n, min_step=10, max_step=90, eta=3, max_concurrent=3)
    run = simulate(tuner, curve, workers=3)
    assert tuner.finished and len(tuner.trials) == n
    steps = sorted({s.step for s in run.submits()})
    assert steps == [10, 30, 90]  # the rungs: ASHA decided promotions
    states = [t.state for t in tuner.study.trials]
    # every stagetree trial is told; a promoted one continues as a new Optuna trial with its whole curve
    assert TrialState.RUNNING not in states and len(states) > n
    complete = [t for t in tuner.study.trials if t.state == TrialState.COMPLETE]
    assert complete and all(set(t.intermediate_values) == {10, 30, 90} for t in complete)
    best = tuner.study.best_trial
    assert best.value == pytest.approx(max(t.results[90]["acc"] for t in tuner.trials.values() if 90 in t.results))


def test_pruner_mode_reports_every_rung_and_optunas_pruner_stops_trials() -> None:
    tuner = OptunaTuner(
        space(), optuna.samplers.TPESampler(seed=0, n_startup_trials=4), metric="loss", mode="min",
        n_trials=20, min_step=10, max_step=90, promotions="pruner", max_concurrent=2,
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=10, reduction_factor=3),
    )  # fmt: skip
    simulate(tuner, curve, workers=2)
    states = [t.state for t in tuner.study.trials]
    assert len(states) == 20 and TrialState.PRUNED in states and TrialState.COMPLETE in states
    pruned = [t for t in tuner.study.trials if t.state == TrialState.PRUNED]
    assert all(max(t.intermediate_values) < 90 for t in pruned)


def test_nsga2_with_two_metrics_runs_each_trial_to_the_end() -> None:
    tuner = OptunaTuner(
        space(), optuna.samplers.NSGAIISampler(seed=0, population_size=4), metric=["acc", "loss"],
        mode=["max", "min"], n_trials=8, max_step=30, promotions="none", max_concurrent=2,
    )  # fmt: skip
    run = simulate(tuner, curve, workers=2)
    assert {s.step for s in run.submits()} == {30}
    assert len(tuner.study.best_trials) >= 1 and all(len(t.values) == 2 for t in tuner.study.trials)
    with pytest.raises(InvalidArgument, match="promotions='none'"):
        OptunaTuner(space(), metric=["acc", "loss"], mode=["max", "min"], n_trials=2, max_step=9)


def test_failures_are_told_and_bad_arguments_are_clear() -> None:
    def flaky(config: TrialConfig, step: int) -> dict[str, float]:
        if float(config["momentum"].value(0)) < 0.6:
            raise RuntimeError("diverged")
        return curve(config, step)

    tuner = OptunaTuner(space(), optuna.samplers.RandomSampler(seed=3), metric="acc", n_trials=12, max_step=30,
                        min_step=10, max_concurrent=2)  # fmt: skip
    simulate(tuner, flaky, workers=2)
    assert any(t.state == TrialState.FAIL for t in tuner.study.trials)
    assert all(t.state != TrialState.RUNNING for t in tuner.study.trials)
    with pytest.raises(InvalidArgument, match="promotions"):
        OptunaTuner(space(), metric="acc", n_trials=2, max_step=9, promotions="bohb")  # type: ignore[arg-type]


def test_hyperband_promotions_draw_from_the_sampler() -> None:
    tuner = OptunaTuner(space(), optuna.samplers.TPESampler(seed=0), metric="acc", n_trials=1, min_step=10,
                        max_step=90, promotions="hyperband")  # fmt: skip
    run = simulate(tuner, curve, workers=4)
    assert tuner.finished and {s.step for s in run.submits()} == {10, 30, 90}
    assert all(isinstance(s, Submit) for s in run.submits())


def test_export_writes_an_optuna_study_that_optuna_reads_back(tmp_path: Path) -> None:
    from stagetree.client.sdk import EvalResult

    cfg_a = {"lr": Warmup(0.01, 5, Cosine(0.1, 0.001, 80))}
    cfg_b = {"lr": Warmup(0.01, 5, Exponential(0.1, 0.95))}
    results = [
        EvalResult(1, "c1", "DONE", 10, 3, {"acc": 0.5}, cfg_a, "", "trial-0"),
        EvalResult(2, "c2", "DONE", 10, 4, {"acc": 0.4}, cfg_b, "", "trial-1"),
        EvalResult(3, "c3", "DONE", 30, 3, {"acc": 0.8}, cfg_a, "", "trial-0"),
        EvalResult(4, "c4", "FAILED", 10, 5, {}, None, "boom", "trial-2"),
    ]
    trials = group_results(results, {5: cfg_b})
    assert [t.label for t in trials] == ["trial-0", "trial-1", "trial-2"] and trials[2].failed == ["boom"]
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    export_to_optuna(trials, storage=url, study_name="digits", metric="acc")
    loaded = optuna.load_study(study_name="digits", storage=url)
    by_label = {t.user_attrs["stagetree_label"]: t for t in loaded.trials}
    assert by_label["trial-0"].state == TrialState.COMPLETE and by_label["trial-0"].value == 0.8
    assert by_label["trial-0"].intermediate_values == {10: 0.5, 30: 0.8}
    assert by_label["trial-1"].state == TrialState.PRUNED and by_label["trial-2"].state == TrialState.FAIL
    assert by_label["trial-0"].params["lr"] == repr(cfg_a["lr"])
    assert loaded.best_trial.user_attrs["stagetree_label"] == "trial-0"
    # optuna's own visualizations read it (the matplotlib-free data functions)
    from optuna.visualization._intermediate_values import _get_intermediate_plot_info

    assert len(_get_intermediate_plot_info(loaded).trial_infos) == 2
    assert isinstance(trials[0], TrialRecord) and trials[0].flat_config()["lr"] == repr(cfg_a["lr"])


def test_max_step_that_is_not_a_rung_is_refused_naming_the_rungs() -> None:
    with pytest.raises(
        InvalidArgument, match=r"max_step=50 is not a rung .* \(rungs \[2, 6, 18\]\).* max_step=18 or 54"
    ):
        OptunaTuner(space(), metric="acc", n_trials=4, min_step=2, max_step=50, eta=3)
    OptunaTuner(space(), metric="acc", n_trials=4, max_step=50, promotions="none")  # one step: any is fine


def test_labelled_choices_and_long_options_give_short_parameter_names() -> None:
    long_options = [Warmup(0.01, 5, Cosine(x, 0.001, 40)) for x in (0.1, 0.05)]
    labelled = OptunaSpace({
        "lr": Choice({"cosine": Family(Cosine, init=LogUniform(0.01, 0.3), min_value=0.001, period=40),
                      "expo": Family(Exponential, init=LogUniform(0.01, 0.3), gamma=0.95)}),
        "warm": Choice(long_options),
    })  # fmt: skip
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    names: set[str] = set()
    for _ in range(12):
        t = study.ask()
        labelled.suggest(t)
        names |= set(t.params)
        assert t.params["lr"] in ("cosine", "expo") and len(t.params["warm"]) <= 40
    assert names >= {"lr", "lr[cosine].init", "lr[expo].init", "warm"}
    assert max(len(n) for n in names) <= 40
    with pytest.raises(InvalidArgument, match="labels"):
        Choice({"": 1})


def test_the_trained_values_and_the_stagetree_trial_are_on_each_optuna_trial() -> None:
    tuner = OptunaTuner(space(grid=3), optuna.samplers.TPESampler(seed=0, n_startup_trials=4), metric="acc",
                        n_trials=9, min_step=10, max_step=90, eta=3, max_concurrent=3)  # fmt: skip
    simulate(tuner, curve, workers=3)
    for t in tuner.study.trials:
        trained = t.user_attrs["stagetree.params"]
        assert trained["momentum"] in (0.5, 0.7, 0.9)  # the grid point, where t.params has the proposal
        label = t.user_attrs["stagetree.trial"]
        mine = tuner.trials[int(label.removeprefix("trial-"))]
        assert float(mine.config["momentum"].value(0)) == trained["momentum"]
    best = tuner.best_params()
    assert best == tuner.study.best_trial.user_attrs["stagetree.params"] and best["momentum"] in (0.5, 0.7, 0.9)


def test_a_warmup_length_drawn_from_a_range_with_none_needs_no_split_space() -> None:
    """``period=IntUniform(0, 3)``: a drawn 0 is no warm-up, and that trial is the plain ``then`` schedule."""
    s = OptunaSpace({"lr": Family(Warmup, init=0.0, period=IntUniform(0, 3), then=Cosine(0.1, 0.001, 40))})
    study = optuna.create_study(sampler=optuna.samplers.GridSampler({"lr.period": [0, 1, 2, 3]}))
    drawn = {}
    for _ in range(4):
        t = study.ask()
        drawn[t.params["lr.period"]] = s.suggest(t)["lr"]
    assert sorted(drawn) == [0, 1, 2, 3]
    assert drawn[0].segments() == Cosine(0.1, 0.001, 40).segments()
    assert drawn[3].value(0) == 0.0 and drawn[3].value(3) == 0.1


def test_a_shared_peak_rate_is_one_optuna_parameter_across_the_families() -> None:
    peak = Shared("peak", LogUniform(0.01, 0.3))
    decay = Choice(
        {
            "cosine": Family(Cosine, init=peak, min_value=0.001, period=80),
            "exp": Family(Exponential, init=peak, gamma=0.95),
            "step": Family(MultiStep, init=peak, milestones=[40], gamma=0.3),
        }
    )
    s = OptunaSpace({"lr": Family(Warmup, init=0.0, period=5, then=decay)})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(12):
        t = study.ask()
        cfg = s.suggest(t)
        assert sorted(t.params) == ["lr.then", "peak"]  # one peak parameter, not one per family
        assert cfg["lr"].value(5) == pytest.approx(t.params["peak"])  # the warm-up ends at the shared peak
    with pytest.raises(InvalidArgument, match="Shared\\('peak'\\) draws from"):
        OptunaSpace({"a": peak, "b": Shared("peak", Uniform(0.0, 1.0))})
