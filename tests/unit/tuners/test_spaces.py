"""Search spaces: grid product and filter, random sampling, reproducibility, bad specs."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.client.spaces import (
    Choice,
    Family,
    GridSearchSpace,
    IntUniform,
    LogUniform,
    RandomSearchSpace,
    Shared,
    Uniform,
)
from stagetree.core.config import Config
from stagetree.core.errors import InvalidArgument, SequenceError
from stagetree.core.sequences import Constant, Cosine, Exponential, MultiStep, Warmup


def test_grid_figure_5_2_gives_four_trials_in_stable_order() -> None:
    space = GridSearchSpace(
        {"lr": [Constant(0.1), Exponential(0.1, 0.95)], "bs": [Constant(128), MultiStep(128, [40], 2)]}
    )
    got = [(c["bs"], c["lr"]) for c in space]
    assert got == [
        (Constant(128), Constant(0.1)),
        (Constant(128), Exponential(0.1, 0.95)),
        (MultiStep(128, [40], 2), Constant(0.1)),
        (MultiStep(128, [40], 2), Exponential(0.1, 0.95)),
    ]
    assert space.size() == len(space) == 4
    assert space.config(3) == {"bs": MultiStep(128, [40], 2), "lr": Exponential(0.1, 0.95)}
    Config.of(space.config(0))  # a trial config the search plan accepts


def test_grid_plain_values_become_constants_and_filter_sees_values_as_written() -> None:
    seen: list[dict[str, object]] = []

    def keep(c: dict[str, object]) -> bool:
        seen.append(c)
        return c["opt"] == "adam" or c["momentum"] == 0.9

    space = GridSearchSpace({"opt": ["sgd", "adam"], "momentum": [0.0, 0.9]}, filter=keep)
    assert {"momentum": 0.0, "opt": "sgd"} in seen
    got = {(c["opt"].value(0), c["momentum"].value(0)) for c in space}
    assert got == {("sgd", 0.9), ("adam", 0.0), ("adam", 0.9)}


@settings(max_examples=60, deadline=None)
@given(
    lists=st.dictionaries(
        st.sampled_from(["a", "b", "c", "d"]),
        st.lists(st.integers(-5, 5), min_size=1, max_size=4, unique=True),
        min_size=1,
    ),
    modulus=st.integers(1, 4),
)
def test_grid_covers_the_filtered_product_exactly_once(lists: dict[str, list[int]], modulus: int) -> None:
    def keep(c: dict[str, object]) -> bool:
        return sum(int(v) for v in c.values()) % modulus == 0  # type: ignore[call-overload]

    names = sorted(lists)
    expected = [p for p in itertools.product(*(lists[n] for n in names)) if sum(p) % modulus == 0]
    if not expected:
        with pytest.raises(InvalidArgument, match="filter rejected"):
            GridSearchSpace(lists, filter=keep)
        return
    space = GridSearchSpace(lists, filter=keep)
    got = [tuple(c[n].value(0) for n in names) for c in space]
    assert got == expected  # the product order, each combination once
    assert [space.config(i) for i in range(space.size())] == list(space)


def test_random_space_samples_families_with_sampled_parameters() -> None:
    space = RandomSearchSpace(
        {
            "lr": Family(MultiStep, init=LogUniform(1e-3, 1e-1), milestones=Choice([[20], [30]]), gamma=0.1),
            "warm": Family(
                Warmup,
                init=0.0,
                period=Choice([5, 10]),
                then=Family(Cosine, init=Uniform(0.1, 1.0), min_value=0.0, period=50),
            ),
            "bs": IntUniform(16, 256),
            "opt": Choice(["sgd", "adam"]),
            "wd": 5e-4,
        },
        seed=7,
    )
    milestones, periods = set(), set()
    for c in space.sample(40):
        lr = c["lr"]
        assert isinstance(lr, MultiStep) and 1e-3 <= lr.init < 1e-1 and lr.gamma == 0.1
        milestones.add(lr.milestones)
        warm = c["warm"]
        assert isinstance(warm, Warmup) and isinstance(warm.then, Cosine)
        periods.add(warm.period)
        assert 0.1 <= warm.then.init < 1.0
        assert isinstance(c["bs"].value(0), int) and 16 <= int(c["bs"].value(0)) <= 256
        assert c["opt"].value(0) in ("sgd", "adam")
        assert c["wd"] == Constant(5e-4)
        Config.of(c)
    assert milestones == {(20,), (30,)} and periods == {5, 10}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**40), indices=st.lists(st.integers(0, 200), min_size=1, max_size=5))
def test_random_space_is_reproducible_from_the_seed(seed: int, indices: list[int]) -> None:
    spec = {
        "lr": LogUniform(1e-4, 1.0),
        "bs": IntUniform(1, 512),
        "s": Family(Exponential, init=Uniform(0, 1), gamma=0.9),
    }
    a = RandomSearchSpace(spec, seed=seed)
    b = RandomSearchSpace(dict(reversed(list(spec.items()))), seed=seed)  # the order written does not matter
    assert [a.config(i) for i in indices] == [b.config(i) for i in reversed(indices)][::-1]
    other = RandomSearchSpace(spec, seed=seed + 1)
    assert a.config(indices[0]) != other.config(indices[0])


def test_log_uniform_spreads_over_decades() -> None:
    rng = random.Random(0)
    d = LogUniform(1e-4, 1.0)
    logs = [math.log10(d.sample(rng)) for _ in range(2000)]
    below = sum(1 for x in logs if x < -2) / len(logs)
    assert 0.45 < below < 0.55  # half the mass under 1e-2: uniform in log, not in value


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (lambda: GridSearchSpace({}), InvalidArgument, "non-empty"),
        (lambda: GridSearchSpace({"lr": 0.1}), InvalidArgument, "lr: must be a list"),  # type: ignore[dict-item]
        (lambda: GridSearchSpace({"lr": []}), InvalidArgument, "lr: must not be empty"),
        (lambda: GridSearchSpace({"lr": [0.1, 0.1]}), InvalidArgument, r"lr\[1\]: duplicates lr\[0\]"),
        (
            lambda: GridSearchSpace({"lr": [{"kind": "step", "init": 1, "step_size": 0, "gamma": 1}]}),
            SequenceError,
            "step_size",
        ),
        (lambda: GridSearchSpace({"lr": [1]}, filter=3), InvalidArgument, "filter must be callable"),  # type: ignore[arg-type]
        (lambda: GridSearchSpace({"lr": [1]}, filter=lambda c: 1 // 0 == 0), InvalidArgument, "filter raised"),
        (lambda: RandomSearchSpace({"lr": [0.1, 0.2]}), InvalidArgument, r"lr: .*Choice"),
        (lambda: RandomSearchSpace({"lr": Uniform(0, 1)}, seed=1.5), InvalidArgument, "seed"),  # type: ignore[arg-type]
        (
            lambda: RandomSearchSpace({"lr": Family(MultiStep, init=0.1, milestones=[0], gamma=0.1)}),
            SequenceError,
            r"lr: milestones\[0\]",
        ),
        (
            lambda: Family(MultiStep, init=0.1, milestone=[3], gamma=0.1),
            InvalidArgument,
            "milestone: unknown parameter",
        ),
        (lambda: Family(MultiStep, init=0.1), InvalidArgument, "milestones: is required"),
        (lambda: Family(dict), InvalidArgument, "cls"),  # type: ignore[arg-type]
        (lambda: Uniform(1.0, 1.0), InvalidArgument, "Uniform: hi"),
        (lambda: Uniform(float("nan"), 1.0), InvalidArgument, "Uniform: lo"),
        (lambda: LogUniform(0.0, 1.0), InvalidArgument, "LogUniform: lo"),
        (lambda: IntUniform(3, 2), InvalidArgument, "IntUniform: hi"),
        (lambda: IntUniform(1.5, 2), InvalidArgument, "IntUniform: lo"),  # type: ignore[arg-type]
        (lambda: Choice([]), InvalidArgument, "Choice: options"),
    ],
)
def test_bad_specs_name_the_field(make: object, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        make()  # type: ignore[operator]


def test_index_errors() -> None:
    space = GridSearchSpace({"x": [1, 2]})
    with pytest.raises(InvalidArgument, match="out of range"):
        space.config(2)
    with pytest.raises(InvalidArgument, match="index"):
        RandomSearchSpace({"x": Uniform(0, 1)}).config(-1)
    with pytest.raises(InvalidArgument, match="no hyper-parameter 'y'"):
        RandomSearchSpace({"x": Uniform(0, 1)}).sample_param("y", random.Random(0))


@settings(max_examples=50)
@given(st.integers(0, 10_000))
def test_a_shared_parameter_is_drawn_once_per_configuration_wherever_it_appears(seed: int) -> None:
    peak = Shared("peak", LogUniform(1e-3, 1e-1))
    space = RandomSearchSpace(
        {
            "lr": Choice(
                [Family(Cosine, init=peak, min_value=0.0, period=40), Family(Exponential, init=peak, gamma=0.9)]
            ),
            "wd": peak,
        },
        seed=seed,
    )
    peaks = set()
    for i in range(5):
        c = space.config(i)
        assert c["lr"].value(0) == c["wd"].value(0)  # one draw, in whichever family was picked
        assert c == space.config(i)  # reproducible
        peaks.add(c["wd"].value(0))
    assert len(peaks) > 1  # drawn anew for each configuration
    alone = {space.sample_param("wd", random.Random(i)).value(0) for i in range(5)}
    assert len(alone) > 1  # resampled alone (PBT), it is drawn anew too


def test_a_shared_name_must_draw_from_one_distribution() -> None:
    with pytest.raises(InvalidArgument, match="Shared\\('peak'\\) draws from"):
        RandomSearchSpace({"a": Shared("peak", LogUniform(1e-3, 1e-1)), "b": Shared("peak", Uniform(0.0, 1.0))})
    with pytest.raises(InvalidArgument, match="cannot wrap another"):
        Shared("a", Shared("b", Uniform(0.0, 1.0)))
