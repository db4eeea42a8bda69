"""Median stopping and PBT against hand-worked examples."""

from __future__ import annotations

import pytest

from stagetree.client.spaces import Choice, GridSearchSpace, LogUniform, RandomSearchSpace, TrialConfig
from stagetree.client.tuners import PBT, MedianStopping, Submit, run_sync
from stagetree.core.config import Config, divergence
from stagetree.core.errors import InvalidArgument
from stagetree.core.sequences import Constant, Exponential, MultiStep, Piecewise

FOREVER = 10**6

# acc of trial x at steps 1, 2, 3
CURVES = {
    0: [0.5, 0.6, 0.7],
    1: [0.3, 0.5, 0.9],
    2: [0.45, 0.5, 0.2],
    3: [0.4, 0.9, 0.9],  # stopped at step 1 before its good step 2
    4: [0.6, 0.1, 0.3],  # its best so far (0.6) keeps it alive at step 2, not its last value (0.1)
}


def curve(sign: float) -> object:
    def evaluate(config: TrialConfig, step: int) -> dict[str, float]:
        return {"acc": sign * CURVES[int(config["x"].value(0))][step - 1]}

    return evaluate


@pytest.mark.parametrize(("mode", "sign"), [("max", 1.0), ("min", -1.0)])
def test_median_stopping_by_hand(mode: str, sign: float) -> None:
    # One at a time: trials 0 and 1 find fewer than min_trials=2 others and run to the end.
    # Trial 2 at step 1: others' averages {0.5, 0.3}, median 0.4 <= 0.45 go on; at step 2: averages
    #   {0.55, 0.4}, median 0.475 <= 0.5 go on.
    # Trial 3 at step 1: {0.5, 0.3, 0.45}, median 0.45 > 0.4: stop.
    # Trial 4 at step 1: median 0.425 <= 0.6; step 2: trials 0,1,2 reached it, averages {0.55, 0.4, 0.475},
    #   median 0.475 <= best so far 0.6 (its value there, 0.1, is worse): go on.
    tuner = MedianStopping(
        GridSearchSpace({"x": [0, 1, 2, 3, 4]}), metric="acc", mode=mode, max_step=3, interval=1,
        min_trials=2, max_concurrent=1,
    )  # fmt: skip
    run = run_sync(tuner, curve(sign))  # type: ignore[arg-type]
    assert {t: (tr.status, tr.last_step()) for t, tr in tuner.trials.items()} == {
        0: ("done", 3), 1: ("done", 3), 2: ("done", 3), 3: ("stopped", 1), 4: ("done", 3),
    }  # fmt: skip
    assert max(s.step for s in run.submits() if s.trial_id == 3) == 1


def test_median_stopping_grace_period_and_min_trials() -> None:
    space = GridSearchSpace({"x": [0, 1, 2, 3, 4]})
    graced = MedianStopping(space, metric="acc", max_step=3, interval=1, min_trials=2, max_concurrent=1, grace_period=2)
    run_sync(graced, curve(1.0))  # type: ignore[arg-type]
    assert graced.trials[3].status == "done"  # step 1 < grace period; at step 2 its 0.9 is fine
    lenient = MedianStopping(space, metric="acc", max_step=3, interval=1, min_trials=5, max_concurrent=1)
    run_sync(lenient, curve(1.0))  # type: ignore[arg-type]
    assert all(t.status == "done" for t in lenient.trials.values())


def test_median_stopping_checkpoints_and_refill() -> None:
    tuner = MedianStopping(
        GridSearchSpace({"x": [0, 1, 2, 3]}), metric="acc", max_step=10, interval=4, max_concurrent=2
    )
    run = run_sync(tuner, lambda c, s: {"acc": 1.0})
    assert sorted({s.step for s in run.submits()}) == [4, 8, 10]
    assert len(tuner.trials) == 4 and all(t.status == "done" for t in tuner.trials.values())


def pbt_space() -> RandomSearchSpace:
    return RandomSearchSpace(
        {"lr": LogUniform(1e-3, 1.0), "bs": Choice([32, 64]), "opt": Choice(["sgd", "adam"]),
         "wd": MultiStep(1e-4, [7], 0.5)},
        seed=11,
    )  # fmt: skip


def target(config: TrialConfig, step: int) -> dict[str, float]:
    return {"acc": -abs(float(config["lr"].value(step - 1)) - 0.05)}


def test_pbt_generations_exploit_and_explore_by_hand() -> None:
    tuner = PBT(pbt_space(), metric="acc", population=4, interval=5, max_step=20, quantile=0.25, seed=3)
    run = run_sync(tuner, target)
    steps = [5, 10, 15, 20]
    # each generation: 4 submits at its step; one new trial per exploit (ceil(0.25 * 4) = 1)
    assert [sum(1 for s in run.submits() if s.step == t) for t in steps] == [4, 4, 4, 4]
    assert len(tuner.trials) == 4 + 3 and len(tuner.exploits) == 3
    for child, source, t in tuner.exploits:
        assert tuner.trials[child].parent == source
        members_at_t = {s.trial_id for s in run.submits() if s.step == t}
        ranked = sorted(members_at_t, key=lambda m: -tuner.trials[m].results[t]["acc"])
        assert source == ranked[0]  # with 4 members the top quantile is the single best
        assert ranked[-1] not in {s.trial_id for s in run.submits() if s.step > t}  # the worst is replaced
        assert child in {s.trial_id for s in run.submits() if s.step == t + 5}


def test_pbt_new_config_shares_the_source_prefix_exactly() -> None:
    tuner = PBT(pbt_space(), metric="acc", population=4, interval=5, max_step=20, seed=3)
    run_sync(tuner, target)
    for child, source, t in tuner.exploits:
        src, new = tuner.trials[source].config, tuner.trials[child].config
        assert divergence(Config.of(src), Config.of(new), 0, FOREVER) == t
        for name in src:
            assert new[name] == Piecewise([src[name], new[name].pieces[1]], [t])  # type: ignore[attr-defined]
            assert src[name].values(0, t) == new[name].values(0, t)
        lr_src, lr_new = float(src["lr"].value(t)), float(new["lr"].value(t))
        assert lr_new / lr_src == pytest.approx(0.8) or lr_new / lr_src == pytest.approx(1.2)
        assert new["opt"].value(t) == src["opt"].value(t)  # strings are kept, not scaled
        assert isinstance(new["bs"].value(t), int)


def test_pbt_is_reproducible_and_resample_draws_from_the_space() -> None:
    def configs(seed: int, p: float) -> list[Config]:
        tuner = PBT(pbt_space(), metric="acc", population=6, interval=4, max_step=12, seed=seed, resample_probability=p)
        return [Config.of(s.config) for s in run_sync(tuner, target).submits()]

    assert configs(1, 0.0) == configs(1, 0.0)
    assert configs(1, 0.0) != configs(2, 0.0)
    resampled = configs(1, 1.0)
    # with resample_probability 1, the new lr after the branch is a LogUniform draw, a constant in range
    tuner = PBT(pbt_space(), metric="acc", population=6, interval=4, max_step=12, seed=1, resample_probability=1.0)
    run_sync(tuner, target)
    for child, _, t in tuner.exploits:
        v = float(tuner.trials[child].config["lr"].value(t))
        assert 1e-3 <= v < 1.0
        assert tuner.trials[child].config["wd"].value(t) == 1e-4  # a fresh MultiStep starts over at t
    assert len(resampled) == len(configs(1, 0.0))


def test_pbt_replaces_failed_members() -> None:
    def flaky(config: TrialConfig, step: int) -> dict[str, float]:
        if config["bs"].value(0) == 64 and step == 5:
            raise RuntimeError("diverged")
        return target(config, step)

    space = GridSearchSpace(
        {"lr": [0.01, 0.02, 0.05, 0.1], "bs": [32, 64]}, filter=lambda c: (c["lr"] in (0.01, 0.1)) == (c["bs"] == 64)
    )
    tuner = PBT(space, metric="acc", population=4, interval=5, max_step=10, seed=0)
    run = run_sync(tuner, flaky)
    failed = [t for t, tr in tuner.trials.items() if tr.status == "failed"]
    assert len(failed) == 2
    assert len({s.trial_id for s in run.submits() if s.step == 10}) == 4  # population kept at 4
    assert {src for _, src, _ in tuner.exploits} == {
        next(t for t, tr in tuner.trials.items() if tr.config["lr"] == Constant(0.05))
    }


def test_pbt_int_float_and_exponential_perturbation() -> None:
    tuner = PBT(
        GridSearchSpace({"lr": [Exponential(0.1, 0.9)], "n": [7]}), metric="acc", population=1, interval=2, max_step=4
    )
    out = tuner.explore({"lr": Exponential(0.1, 0.9), "n": Constant(7)}, 2)
    assert out["lr"].value(1) == Exponential(0.1, 0.9).value(1)
    assert out["lr"].value(2) in (pytest.approx(0.1 * 0.81 * 0.8), pytest.approx(0.1 * 0.81 * 1.2))
    assert out["n"].value(3) in (6, 8)


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"quantile": 0.0}, "quantile"),
        ({"quantile": 0.75}, "quantile"),
        ({"perturb_factors": ()}, "perturb_factors"),
        ({"perturb_factors": (0.8, -1.0)}, "perturb_factors"),
        ({"resample_probability": 1.5}, "resample_probability"),
        ({"interval": 0}, "interval"),
        ({"population": 0}, "population"),
    ],
)
def test_pbt_bad_arguments(kw: dict[str, object], fragment: str) -> None:
    args: dict[str, object] = {"metric": "acc", "population": 4, "interval": 5, "max_step": 20}
    args.update(kw)
    with pytest.raises(InvalidArgument, match=fragment):
        PBT(pbt_space(), **args)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="RandomSearchSpace"):
        PBT(GridSearchSpace({"x": [1]}), metric="acc", population=1, interval=1, max_step=2, resample_probability=0.5)


def test_submit_configs_are_the_trials() -> None:
    tuner = PBT(pbt_space(), metric="acc", population=2, interval=5, max_step=10)
    for a in tuner.start():
        assert isinstance(a, Submit) and a.config is tuner.trials[a.trial_id].config
