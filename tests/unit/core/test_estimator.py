"""Cost estimator: regression recovery, cold start, profiling runs, OOM doubling, per-GPU-type
profiles, stage costs for the scheduler, persistence and bad input."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.config import Config
from stagetree.core.errors import InvalidArgument
from stagetree.core.estimator import (
    COLD_SECONDS_PER_STEP,
    CostModel,
    features_of,
    fit_linear,
    run_seconds_per_step,
)
from stagetree.core.stagetree import Stage

PLAN = "plan-a"
GPU = "A100"


def time_law(bs: float) -> float:
    return 0.002 + 0.0005 * bs


def mem_law(bs: float) -> float:
    return 1e9 + 2e7 * bs


def trained(*, gpu: str = GPU, sizes: tuple[int, ...] = (16, 32, 64, 128)) -> CostModel:
    m = CostModel()
    for bs in sizes:
        m.observe(PLAN, gpu, {"bs": bs}, time_law(bs), mem_law(bs))
    return m


def test_recovers_a_noiseless_linear_law() -> None:
    m = trained()
    for bs in (1, 48, 256, 1024):
        assert m.seconds_per_step(PLAN, GPU, {"bs": bs}) == pytest.approx(time_law(bs), rel=1e-9)
        assert m.peak_memory(PLAN, GPU, {"bs": bs}) == pytest.approx(mem_law(bs), rel=1e-9)


def test_recovers_a_law_in_two_features_and_ignores_unlisted_ones() -> None:
    m = CostModel(["bs", "seq_len"])
    for bs, seq in [(8, 128), (16, 128), (8, 512), (32, 256), (64, 1024)]:
        m.observe(PLAN, GPU, {"bs": bs, "seq_len": seq, "lr": bs * 1e-3}, 0.01 + 0.001 * bs + 2e-5 * seq, 1e6 * bs)
    assert m.seconds_per_step(PLAN, GPU, {"bs": 100, "seq_len": 2048}) == pytest.approx(0.01 + 0.1 + 2e-5 * 2048)
    assert m.seconds_per_step(PLAN, GPU, {"bs": 100, "seq_len": 2048, "lr": 5.0}) == pytest.approx(0.151, rel=1e-3)


def test_collinear_features_stay_solvable() -> None:
    m = CostModel()  # bs and batch_size, both given and always equal
    for bs in (8, 16, 32):
        m.observe(PLAN, GPU, {"bs": bs, "batch_size": bs}, time_law(bs), mem_law(bs))
    assert m.seconds_per_step(PLAN, GPU, {"bs": 64, "batch_size": 64}) == pytest.approx(time_law(64), rel=1e-6)


@settings(max_examples=50, deadline=None)
@given(
    a=st.floats(1e-3, 10.0),
    b=st.floats(-1e-3, 1e-2),
    sizes=st.lists(st.integers(1, 4096), min_size=2, max_size=8, unique=True),
)
def test_any_line_is_recovered(a: float, b: float, sizes: list[int]) -> None:
    xs = [{"bs": float(s)} for s in sizes]
    ys = [a + b * s for s in sizes]
    fit = fit_linear(xs, ys, ["bs"], 1e-12)
    for s in (1, 512, 4096):
        assert fit.predict({"bs": s}) == pytest.approx(a + b * s, rel=1e-6, abs=1e-9)


def test_falls_back_to_the_mean_when_features_do_not_vary() -> None:
    m = CostModel(["seq_len"])  # not a size taken as proportional
    for t in (1.0, 2.0, 3.0):
        m.observe(PLAN, GPU, {"seq_len": 32}, t, 100.0)
    assert m.seconds_per_step(PLAN, GPU, {"seq_len": 32}) == pytest.approx(2.0)
    assert m.seconds_per_step(PLAN, GPU, {"seq_len": 4096}) == pytest.approx(2.0)
    m.observe(PLAN, GPU, {}, 6.0, 100.0)  # a run without the feature: not every sample has it
    assert m.seconds_per_step(PLAN, GPU, {"seq_len": 1}) == pytest.approx(3.0)


def test_a_batch_size_seen_at_one_value_scales_the_time_proportionally_until_a_second_one() -> None:
    m = CostModel()
    for t in (1.0, 2.0, 3.0):
        m.observe(PLAN, GPU, {"bs": 32}, t, 100.0)
    assert m.seconds_per_step(PLAN, GPU, {"bs": 32}) == pytest.approx(2.0)
    assert m.seconds_per_step(PLAN, GPU, {"bs": 128}) == pytest.approx(8.0)  # four times the samples
    assert m.seconds_per_step(PLAN, GPU, {"bs": 16}) == pytest.approx(1.0)
    assert m.seconds_per_step(PLAN, GPU, {}) == pytest.approx(2.0)  # no size given: the mean
    m.observe(PLAN, GPU, {"bs": 64}, 2.0, 100.0)  # two sizes now: the fitted line decides
    line = fit_linear([{"bs": 32}] * 3 + [{"bs": 64}], [1.0, 2.0, 3.0, 2.0], ["bs"], 1e-12)
    assert m.seconds_per_step(PLAN, GPU, {"bs": 128}) == pytest.approx(line.predict({"bs": 128}))
    assert CostModel(proportional=()).seconds_per_step(PLAN, GPU, {"bs": 128}) == COLD_SECONDS_PER_STEP


def test_a_feature_missing_from_the_query_is_taken_at_its_mean() -> None:
    m = trained()  # mean bs = 60
    assert m.seconds_per_step(PLAN, GPU, {}) == pytest.approx(time_law(60))


def test_cold_start() -> None:
    m = CostModel()
    assert m.seconds_per_step(PLAN, GPU, {"bs": 64}) == COLD_SECONDS_PER_STEP == 1.0
    assert m.peak_memory(PLAN, GPU, {"bs": 64}) is None
    assert m.gpus_for(PLAN) == 1
    assert m.observations(PLAN, GPU) == []


def test_profiles_are_per_gpu_type_and_per_plan() -> None:
    m = trained(gpu="A100")
    m.observe(PLAN, "V100", {"bs": 16}, 0.5, 1e9)
    m.observe(PLAN, "V100", {"bs": 64}, 1.1, 2e9)
    assert m.seconds_per_step(PLAN, "A100", {"bs": 32}) == pytest.approx(time_law(32))
    assert m.seconds_per_step(PLAN, "V100", {"bs": 32}) == pytest.approx(0.7)
    assert m.seconds_per_step(PLAN, "H100", {"bs": 32}) == 1.0
    assert m.seconds_per_step("plan-b", "A100", {"bs": 32}) == 1.0


def test_a_profiling_run_drops_its_first_step() -> None:
    assert run_seconds_per_step([9.0, 1.0, 2.0, 3.0]) == 2.0
    m = CostModel()
    assert m.observe_run(PLAN, GPU, {"bs": 8}, [30.0] + [0.25] * 9, 5e8) == 0.25
    assert m.seconds_per_step(PLAN, GPU, {"bs": 8}) == 0.25
    with pytest.raises(InvalidArgument, match="at least 2"):
        run_seconds_per_step([1.0])
    with pytest.raises(InvalidArgument):
        run_seconds_per_step([1.0, -1.0])


def test_oom_doubles_gpus_up_to_the_cap() -> None:
    m = CostModel(max_gpus=8)
    assert [m.gpus_for(PLAN, k) for k in range(6)] == [1, 2, 4, 8, 8, 8]
    assert m.gpus_for(PLAN, 10**9) == 8
    assert m.record_oom(PLAN, 1) == 2  # later stages of this plan start at 2
    assert [m.gpus_for(PLAN, k) for k in range(3)] == [2, 4, 8]
    assert m.gpus_for("other", 0) == 1
    assert m.record_oom(PLAN, 8) == 8
    assert m.record_oom(PLAN, 1) == 8  # never lowered
    assert CostModel(max_gpus=6).gpus_for(PLAN, 3) == 6
    with pytest.raises(InvalidArgument):
        m.gpus_for(PLAN, -1)
    with pytest.raises(InvalidArgument):
        m.record_oom(PLAN, 0)


def test_stage_cost_uses_the_midpoint_values() -> None:
    # bs is 32 on [0, 100) and 128 from step 100; lr does not change cost.
    cfg = Config.of({"bs": {"kind": "multistep", "init": 32, "milestones": [100], "gamma": 4}, "lr": 0.1})
    assert features_of(cfg, 99) == {"bs": 32.0}
    assert features_of(cfg, 100) == {"bs": 128.0}
    m = trained()
    cost = m.stage_cost({7: cfg}.__getitem__, PLAN, GPU)
    assert cost(Stage(0, PLAN, 7, 0, 50)) == pytest.approx(50 * time_law(32))
    assert cost(Stage(1, PLAN, 7, 80, 160)) == pytest.approx(80 * time_law(128))  # midpoint 120
    assert cost(Stage(2, PLAN, 7, 40, 40)) == 0.0
    assert m.stage_cost({7: cfg}.__getitem__, PLAN, "T4")(Stage(0, PLAN, 7, 0, 50)) == 50.0  # cold


def test_json_round_trip() -> None:
    m = trained()
    m.observe(PLAN, "V100", {"bs": 16, "batch_size": 16}, 0.5, 1e9)
    m.record_oom(PLAN, 2)
    blob = json.loads(json.dumps(m.to_json()))
    m2 = CostModel.from_json(blob)
    assert m2.to_json() == m.to_json()
    assert m2.seconds_per_step(PLAN, GPU, {"bs": 200}) == m.seconds_per_step(PLAN, GPU, {"bs": 200})
    assert m2.gpus_for(PLAN) == 4


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.pop("profiles"),
        lambda o: o.update(version=99),
        lambda o: o.update(max_gpus=0),
        lambda o: o["profiles"][0]["observations"][0].update(seconds_per_step=-1),
        lambda o: o["profiles"][0]["observations"][0].update(features={"bs": "big"}),
        lambda o: o["profiles"][0].update(observations=[{"features": {}}]),
        lambda o: o.update(min_gpus={PLAN: 64}),
        lambda o: o.update(min_gpus=[1]),
    ],
)
def test_malformed_json_is_invalid_argument(mutate: Any) -> None:
    o = trained().to_json()
    o["min_gpus"] = {PLAN: 2}
    mutate(o)
    with pytest.raises(InvalidArgument):
        CostModel.from_json(o)
    with pytest.raises(InvalidArgument):
        CostModel.from_json([1, 2])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((PLAN, GPU, {"bs": 8}, 0.0, 1.0), "seconds_per_step"),
        ((PLAN, GPU, {"bs": 8}, math.inf, 1.0), "seconds_per_step"),
        ((PLAN, GPU, {"bs": 8}, True, 1.0), "seconds_per_step"),
        ((PLAN, GPU, {"bs": 8}, 1.0, -1.0), "peak_memory_bytes"),
        ((PLAN, GPU, {"bs": math.nan}, 1.0, 1.0), "features"),
        ((PLAN, GPU, {"bs": True}, 1.0, 1.0), "features"),
        ((PLAN, GPU, {"": 1.0}, 1.0, 1.0), "features"),
        ((PLAN, GPU, [("bs", 8)], 1.0, 1.0), "features"),
        ((None, GPU, {"bs": 8}, 1.0, 1.0), "plan_key"),
        ((PLAN, 3, {"bs": 8}, 1.0, 1.0), "gpu_type"),
    ],
)
def test_bad_observations_are_invalid_argument(args: tuple[Any, ...], match: str) -> None:
    m = CostModel()
    with pytest.raises(InvalidArgument, match=match):
        m.observe(*args)
    assert m.observations(PLAN, GPU) == []


@pytest.mark.parametrize(
    "kwargs",
    [{"feature_names": [""]}, {"ridge": 0.0}, {"ridge": math.nan}, {"max_gpus": 0}, {"max_observations": 0}],
)
def test_bad_settings_are_invalid_argument(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        CostModel(**kwargs)


def test_old_observations_age_out() -> None:
    m = CostModel(max_observations=2)
    m.observe(PLAN, GPU, {"bs": 1}, 100.0, 1.0)
    m.observe(PLAN, GPU, {"bs": 2}, 1.0, 1.0)
    m.observe(PLAN, GPU, {"bs": 2}, 3.0, 1.0)
    # only the two at bs=2 are left (with the first, the line through them would fall below 0 at bs=4)
    assert m.seconds_per_step(PLAN, GPU, {"bs": 4}) == pytest.approx(4.0)


def test_fit_linear_rejects_mismatched_samples() -> None:
    with pytest.raises(InvalidArgument):
        fit_linear([{"bs": 1.0}], [1.0, 2.0], ["bs"], 1e-12)
    with pytest.raises(InvalidArgument):
        fit_linear([], [], ["bs"], 1e-12)
