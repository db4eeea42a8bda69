"""``CurveSampling``: what a study asks of its learning curves, checked at the boundary, and the one
sampling a batch serving several studies uses (it keeps every point each of them asked for)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagetree.core.batch import MAX_CURVE_EVERY_STEPS, CurveRate, CurveSampling
from stagetree.core.errors import InvalidArgument

samplings = st.builds(
    CurveSampling,
    every_steps=st.integers(0, 500),
    max_per_s=st.one_of(st.just(0.0), st.floats(0.01, 1000.0)),
)


def _kept(c: CurveSampling, horizon: int) -> set[int]:
    """The steps a sampling keeps up to ``horizon`` (rate limit aside)."""
    return set() if c.every_steps == 0 else set(range(c.every_steps, horizon + 1, c.every_steps))


@given(st.lists(samplings, min_size=1, max_size=5))
def test_the_finest_keeps_every_step_and_the_rate_each_asked_for(wanted: list[CurveSampling]) -> None:
    got = CurveSampling.finest(wanted)
    horizon = 2000
    for c in wanted:
        assert _kept(c, horizon) <= _kept(got, horizon)
        if c.every_steps > 0:  # a limit no lower than any asked for (0: none)
            assert got.max_per_s == 0 or (c.max_per_s != 0 and got.max_per_s >= c.max_per_s)
    if all(c.every_steps == 0 for c in wanted):
        assert got.every_steps == 0  # nobody wants a curve: none
    else:  # and no finer than needed: the largest step that divides every asked step
        assert got.every_steps == math.gcd(*(c.every_steps for c in wanted))


def test_the_finest_of_one_is_itself_and_of_none_the_default() -> None:
    assert CurveSampling.finest([CurveSampling(7, 3.0)]) == CurveSampling(7, 3.0)
    assert CurveSampling.finest([]) == CurveSampling()
    assert CurveSampling.finest([CurveSampling(0, 5.0), CurveSampling(4, 2.0)]) == CurveSampling(4, 2.0)


@pytest.mark.parametrize(
    ("every", "rate", "field"),
    [
        (-1, 0.0, "curve_every_steps"),
        (MAX_CURVE_EVERY_STEPS + 1, 0.0, "curve_every_steps"),
        (2.5, 0.0, "curve_every_steps"),
        (True, 0.0, "curve_every_steps"),
        (1, -0.1, "curve_max_per_s"),
        (1, math.inf, "curve_max_per_s"),
        (1, math.nan, "curve_max_per_s"),
        (1, "5", "curve_max_per_s"),
    ],
)
def test_a_bad_sampling_names_its_field(every: object, rate: object, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field):
        CurveSampling(every, rate)  # type: ignore[arg-type]


@given(
    per_s=st.floats(0.1, 100),
    burst=st.integers(1, 50),
    gaps=st.lists(st.floats(0, 2, allow_nan=False), min_size=1, max_size=300),
)
def test_curve_rate_keeps_a_burst_then_at_most_its_rate(per_s: float, burst: int, gaps: list[float]) -> None:
    rate = CurveRate(per_s, burst)
    times = list(itertools.accumulate(gaps))
    kept = [t for t in times if rate.take(t)]
    assert kept[: min(burst, len(times))] == times[:burst]  # the first `burst` points are all kept
    for i, t in enumerate(kept):  # never more than the burst plus what the rate refilled since the first
        assert i + 1 <= burst + (t - times[0]) * per_s + 1e-9


def test_curve_rate_zero_is_no_limit_and_a_short_run_keeps_every_step() -> None:
    assert all(CurveRate(0.0, 1).take(0.0) for _ in range(1000))
    default = CurveRate(20.0)
    assert all(default.take(i * 1e-4) for i in range(20))  # 20 steps of 0.1 ms: each one kept
