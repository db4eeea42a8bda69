"""The pure pieces the dashboard draws with: the tuned choices a schedule stands for, the importance
estimate, the slots' busy history, and a failure's text taken apart."""

from __future__ import annotations

import math
import random
import traceback

from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.failures import log_note, parse_failure
from stagetree.core.importance import epsilon_squared, importance
from stagetree.core.lifecycle import MAX_ERROR_CHARS
from stagetree.core.schedule_features import features, study_features
from stagetree.core.sequences import (
    Constant,
    Cosine,
    CyclicLR,
    Exponential,
    Linear,
    MultiStep,
    Step,
    Warmup,
    value_at,
)
from stagetree.core.utilisation import busy_history, merged
from stagetree.nodemanager.runtime.executor import error_text

# -- schedule features ----------------------------------------------------------------------------


def test_a_warmup_then_decay_reads_back_as_its_family_peak_and_warmup() -> None:
    f = features(Warmup(0.01, 5, Cosine(0.1, 0.001, 95)).segments(), 100)
    assert f["family"] == "warmup+cosine" and f["warmup"] == 5 and f["peak"] == 0.1 and f["init"] == 0.01
    assert f["final"] == value_at(Warmup(0.01, 5, Cosine(0.1, 0.001, 95)).segments(), 99)
    assert features(MultiStep(0.1, [30, 60], 0.1).segments(), 90)["family"] == "step"
    assert features(Warmup(0.02, 5, Exponential(0.2, 0.98)).segments(), 90)["family"] == "warmup+exponential"
    assert features(Constant("adam").segments(), 10) == {"": "adam"}
    assert features(Constant(32).segments(), 10, as_schedule=True)["family"] == "constant"


SCHEDULES = st.one_of(
    st.builds(Constant, st.floats(0.001, 1.0)),
    st.builds(Linear, st.floats(0.001, 1.0), st.floats(-0.001, 0.001)),
    st.builds(Exponential, st.floats(0.001, 1.0), st.floats(0.9, 1.0)),
    st.builds(Step, st.floats(0.001, 1.0), st.integers(1, 40), st.floats(0.1, 1.0)),
    st.builds(Cosine, st.floats(0.01, 1.0), st.floats(0.0, 0.01), st.integers(1, 60)),
    st.builds(CyclicLR, st.floats(0.001, 0.01), st.floats(0.1, 1.0), st.integers(1, 20), st.integers(1, 20)),
    st.builds(
        Warmup,
        st.floats(0.0, 0.01),
        st.integers(1, 20),
        st.builds(Cosine, st.floats(0.05, 1.0), st.just(0.0), st.integers(1, 80)),
    ),
)


@settings(max_examples=150, deadline=None)
@given(SCHEDULES, st.integers(1, 120))
def test_peak_init_and_final_are_the_schedules_own_values(seq: object, until: int) -> None:
    segs = seq.segments()  # type: ignore[attr-defined]
    f = features(segs, until, as_schedule=True)
    values = [float(value_at(segs, s)) for s in range(until)]
    assert math.isclose(float(f["peak"]), max(values), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(float(f["init"]), values[0]) and math.isclose(float(f["final"]), values[-1])
    assert 0 <= int(f["warmup"]) < max(2, until)


def test_study_features_keep_what_varies_over_the_studys_horizon() -> None:
    trials = {
        "a": [("bs", Constant(32).segments()), ("lr", Warmup(0.01, 5, Cosine(0.1, 0.0, 95)).segments())],
        "b": [("bs", Constant(32).segments()), ("lr", Warmup(0.01, 10, Cosine(0.2, 0.0, 90)).segments())],
        "c": [("bs", MultiStep(32, [50], 2).segments()), ("lr", MultiStep(0.1, [50], 0.1).segments())],
    }
    names, rows = study_features(trials, 100)
    assert "lr.warmup" in names and "lr.peak" in names and "lr.family" in names and "lr.init" in names
    assert rows["a"]["lr.family"] == "warmup+cosine" and rows["c"]["lr.family"] == "step"
    assert rows["a"]["bs.family"] == "constant" and rows["c"]["bs.final"] == 64  # a schedule in one: in all
    same = {k: [("m", Constant(0.9).segments()), *v] for k, v in trials.items()}
    assert "m" not in study_features(same, 100)[0]  # fixed in every trial: not a choice


# -- importance -----------------------------------------------------------------------------------


def test_the_choice_that_decides_the_metric_is_the_important_one() -> None:
    rng = random.Random(0)
    rows = [
        {"peak": rng.choice([0.01, 0.1, 1.0]), "warmup": rng.randint(0, 20), "family": rng.choice("ab")}
        for _ in range(300)
    ]
    ys = [r["peak"] * 10 + rng.gauss(0, 0.1) for r in rows]
    imp = importance(rows, ys)
    assert max(imp, key=imp.__getitem__) == "peak" and imp["peak"] > 0.9
    assert math.isclose(sum(imp.values()), 1.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e3, 1e3), st.sampled_from("abc"), st.floats(-1e3, 1e3)), min_size=0, max_size=60))
def test_importances_are_shares_that_a_monotone_rescaling_does_not_change(data: list[tuple[float, str, float]]) -> None:
    rows = [{"x": x, "c": c} for x, c, _ in data]
    ys = [y for _, _, y in data]
    imp = importance(rows, ys)
    assert all(0.0 <= v <= 1.0 for v in imp.values())
    assert math.isclose(sum(imp.values()), 1.0) or sum(imp.values()) == 0.0
    # a monotone squashing that keeps every value apart (atan of floats can merge neighbours, e.g. 0 and
    # 5e-324): each value to atan of its rank, so the order and the ties are those of x, hence the same bins
    rank = {v: i for i, v in enumerate(sorted({x for x, _, _ in data}))}
    squashed = [{"x": math.atan(rank[x] - 30.0), "c": c} for x, c, _ in data]
    assert epsilon_squared([r["x"] for r in squashed], ys) == epsilon_squared([r["x"] for r in rows], ys)


# -- busy history ---------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("ab"), st.floats(0, 100), st.floats(0, 50) | st.none()), max_size=30),
    st.integers(1, 40),
)
def test_a_slot_is_never_busier_than_one_and_the_area_is_its_busy_time(
    spans: list[tuple[str, float, float | None]], buckets: int
) -> None:
    intervals = [(s, a, None if d is None else a + d) for s, a, d in spans]
    got = busy_history(intervals, 0.0, 100.0, buckets)
    assert all(-1e-9 <= v <= 2 + 1e-9 for v in got)  # two slots at most
    width = 100.0 / buckets
    ends = [(x, a, 100.0 if e is None else min(100.0, e)) for x, a, e in intervals]
    busy = sum(b - a for s in "ab" for a, b in merged([(a, e) for x, a, e in ends if x == s]))
    assert math.isclose(sum(got) * width, busy, rel_tol=1e-6, abs_tol=1e-6)


def test_a_batch_sent_ahead_does_not_count_its_slot_twice() -> None:
    # one batch runs 0-60; the next was sent at 40 but starts when the slot frees, at 60
    assert busy_history([("s", 0, 60), ("s", 60, None)], 0, 100, 4) == [1.0, 1.0, 1.0, 1.0]
    assert busy_history([("s", 0, 60), ("s", 40, 90)], 0, 100, 1) == [0.9]


# -- failures -------------------------------------------------------------------------------------


def _raise_deep() -> None:
    def inner() -> None:
        raise ValueError("deep trouble")

    inner()


def test_a_failure_written_as_the_node_manager_writes_it_comes_apart() -> None:
    try:
        _raise_deep()
    except ValueError as e:
        text = f"{error_text(e, traceback.format_exc())}\n{log_note('/srv/logs/batch-3-a1.log', 'gpu-1')}"
    f = parse_failure(text)
    assert f.headline == "ValueError: deep trouble"
    assert f.traceback.startswith("Traceback (most recent call last)") and "in inner" in f.traceback
    assert (f.log_path, f.node_manager) == ("/srv/logs/batch-3-a1.log", "gpu-1")
    cut = parse_failure(text[-200:])  # the store keeps the end of a long text
    assert cut.headline == "ValueError: deep trouble" and cut.log_path == "/srv/logs/batch-3-a1.log"
    assert parse_failure("the worker died (exit 17)").headline == "the worker died (exit 17)"
    assert MAX_ERROR_CHARS > 200


@given(st.text(max_size=300))
def test_any_text_parses_into_a_one_line_headline(text: str) -> None:
    f = parse_failure(text)
    assert "\n" not in f.headline and f.text == text
