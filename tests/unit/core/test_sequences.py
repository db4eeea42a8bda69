"""Sequence families against hand-computed values, canonical forms, sharing and bad input."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagetree.core.config import Config, divergence
from stagetree.core.errors import SequenceError
from stagetree.core.sequences import (
    OVERFLOW,
    Constant,
    Cosine,
    CyclicLR,
    Exponential,
    Linear,
    MultiStep,
    Piecewise,
    Segment,
    Step,
    Warmup,
    _cosine_place,
    first_divergence,
    from_json,
    segments_from_json,
    segments_to_json,
    value_at,
)


def test_warmup_then_cosine_by_hand() -> None:
    seq = Warmup(0.0, 10, Cosine(0.1, 0.0, 90))
    assert seq.value(0) == 0.0
    assert seq.value(5) == pytest.approx(0.05)
    assert seq.value(10) == pytest.approx(0.1)
    # 45 steps into a 90-step cosine: halfway, (1 + cos(pi/2)) / 2 = 0.5
    assert seq.value(55) == pytest.approx(0.05)
    assert seq.value(100) == pytest.approx(0.1)  # warm restart


def test_cosine_restarts_multiply_period() -> None:
    seq = Cosine(1.0, 0.0, 4, gamma=2.0)
    # cycles: [0,4), [4,12), [12,28)
    assert seq.value(2) == pytest.approx(0.5)
    assert seq.value(4) == pytest.approx(1.0)
    assert seq.value(8) == pytest.approx(0.5)
    assert seq.value(12) == pytest.approx(1.0)
    assert seq.value(20) == pytest.approx(0.5)


def test_multistep_step_exponential_linear() -> None:
    ms = MultiStep(0.1, [30, 60], 0.1)
    assert [ms.value(t) for t in (0, 29, 30, 59, 60, 1000)] == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])
    stp = Step(1.0, 10, 0.5)
    assert [stp.value(t) for t in (0, 9, 10, 25)] == pytest.approx([1.0, 1.0, 0.5, 0.25])
    assert Exponential(0.1, 0.9).value(3) == pytest.approx(0.1 * 0.9**3)
    assert Linear(1.0, -0.25).value(2) == pytest.approx(0.5)


def test_cyclic_triangle() -> None:
    seq = CyclicLR(0.0, 1.0, 4, 2)
    assert [seq.value(t) for t in range(8)] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 0.5, 0.0, 0.25])


def test_int_sequences_stay_int() -> None:
    bs = MultiStep(128, [40], 2)
    assert bs.value(0) == 128 and isinstance(bs.value(0), int)
    assert bs.value(40) == 256 and isinstance(bs.value(40), int)
    assert Constant("adam").value(7) == "adam"


def test_paper_example_shares_prefix() -> None:
    a = MultiStep(0.1, [100], 0.5).segments()
    b = Constant(0.1).segments()
    assert first_divergence(a, b, 0, 1000) == 100
    assert first_divergence(a, b, 0, 50) == 50


def test_equal_schedules_hash_equal() -> None:
    assert Exponential(0.1, 1.0) == Constant(0.1)
    assert hash(MultiStep(0.1, [], 0.5)) == hash(Constant(0.1))
    split = Piecewise([Exponential(0.1, 0.9), Exponential(0.1 * 0.9**50, 0.9)], [50])
    assert split == Exponential(0.1, 0.9)
    assert Constant(0.1 + 0.2) == Constant(0.3)  # canonical floats


def test_concatenation_restarts_local_time() -> None:
    seq = Piecewise([Constant(0.1), Exponential(0.1, 0.5)], [20])
    assert seq.value(19) == 0.1
    assert seq.value(20) == pytest.approx(0.1)
    assert seq.value(22) == pytest.approx(0.025)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Cosine(0.1, 0.0, -5), "period"),
        (lambda: Exponential(0.1, 0.0), "gamma"),
        (lambda: Step(0.1, 10, -1.0), "gamma"),
        (lambda: MultiStep(0.1, [50, 20], 0.1), "milestones[1]"),
        (lambda: Constant(math.nan), "value"),
        (lambda: Linear(math.inf, 0.0), "init"),
        (lambda: from_json({"kind": "sawtooth"}), "kind"),
        (lambda: from_json({"kind": "cosine", "init": 0.1}), "min_value"),
        (lambda: segments_from_json([[0, None, "wiggle", ["float", 1.0]]]), "segments[0].kind"),
    ],
)
def test_bad_input_names_the_field(make, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SequenceError) as err:
        make()
    assert err.value.field == field
    assert field in str(err.value)


# -- properties --------------------------------------------------------------------------------

floats = st.floats(min_value=1e-4, max_value=1.0, allow_nan=False)
steps = st.integers(min_value=1, max_value=60)


@st.composite
def sequences(draw: st.DrawFn, depth: int = 0) -> object:
    kind = draw(st.sampled_from(["const", "exp", "multistep", "step", "cosine", "cyclic", "warmup", "piecewise"]))
    if kind == "const":
        return Constant(draw(st.sampled_from([0.1, 0.05, 0.01])))
    if kind == "exp":
        return Exponential(draw(floats), draw(st.sampled_from([0.9, 0.5, 1.0])))
    if kind == "multistep":
        ms = sorted(set(draw(st.lists(steps, max_size=3))))
        return MultiStep(draw(st.sampled_from([0.1, 0.05])), ms, draw(st.sampled_from([0.1, 0.5])))
    if kind == "step":
        return Step(draw(floats), draw(steps), draw(st.sampled_from([0.5, 0.9])))
    if kind == "cosine":
        return Cosine(draw(floats), 0.0, draw(steps), draw(st.sampled_from([1.0, 2.0])))
    if kind == "cyclic":
        return CyclicLR(0.0, draw(floats), draw(steps), draw(steps))
    if depth > 1:
        return Constant(0.1)
    if kind == "warmup":
        return Warmup(0.0, draw(steps), draw(sequences(depth + 1)))
    b = draw(steps)
    return Piecewise([draw(sequences(depth + 1)), draw(sequences(depth + 1))], [b])


@given(sequences())
def test_json_round_trip_and_segments_evaluate_the_same(seq) -> None:  # type: ignore[no-untyped-def]
    again = from_json(json.loads(json.dumps(seq.to_json())))
    assert again == seq and hash(again) == hash(seq)
    segs = segments_from_json(json.loads(json.dumps(segments_to_json(seq.segments()))))
    assert segs == seq.segments()
    cfg = Config.of({"x": seq})
    back = Config.from_json(json.loads(json.dumps(cfg.to_json())))
    for t in range(0, 130, 7):
        assert back.values_at(t)["x"] == pytest.approx(seq.value(t), rel=1e-9, abs=1e-12)


@given(sequences(), sequences(), st.integers(min_value=1, max_value=150))
def test_divergence_means_values_agree_before_it(a, b, limit) -> None:  # type: ignore[no-untyped-def]
    ca, cb = Config.of({"x": a}), Config.of({"x": b})
    d = divergence(ca, cb, 0, limit)
    assert 0 <= d <= limit
    for t in range(d):
        assert ca.values_at(t)["x"] == pytest.approx(cb.values_at(t)["x"], rel=1e-9, abs=1e-12)
    assert divergence(ca, ca, 0, limit) == limit


def test_config_of_accepts_the_canonical_segment_form_it_gives() -> None:
    from stagetree.core.config import Config

    cfg = Config.of({"lr": {"kind": "multistep", "init": 0.1, "milestones": [10], "gamma": 0.5}, "bs": 32})
    assert Config.of(cfg.to_json()) == cfg
    assert Config.of({**cfg.to_json(), "bs": 32}) == cfg


@pytest.mark.parametrize(
    ("segment", "field"),
    [
        ([0, None, "const", [["float"], 1.0]], "segments[0].params"),  # found by the REST fuzzer: was a 500
        ([0, None, ["const"], ["float", 1.0]], "segments[0].kind"),
    ],
)
def test_a_segment_with_a_list_where_a_name_belongs_is_a_sequence_error(segment: list[object], field: str) -> None:
    with pytest.raises(SequenceError, match=field.replace("[", r"\[").replace("]", r"\]")):
        segments_from_json([segment])


@given(sequences(), st.text(min_size=1, max_size=12))
def test_an_unknown_field_in_a_family_object_is_refused_naming_it(seq, extra: str) -> None:  # type: ignore[no-untyped-def]
    obj = seq.to_json()
    assert from_json(obj) == seq  # what the core writes, it reads: every field it writes is known
    if extra in obj:
        return
    with pytest.raises(SequenceError) as err:
        Config.of({"lr": {**obj, extra: 1}})
    assert err.value.field == extra and f"is not a field of {obj['kind']}" in str(err.value)


def test_a_warmup_of_no_steps_is_its_then_and_shares_its_whole_path() -> None:
    then = Cosine(0.1, 0.001, 40)
    none = Warmup(0.0, 0, then=then)
    assert none.segments() == then.segments() and repr(none) == repr(then)
    assert Config.of({"lr": none}) == Config.of({"lr": then})  # the same trial, so the same plan path
    assert [none.value(s) for s in (0, 7, 39)] == [then.value(s) for s in (0, 7, 39)]
    with pytest.raises(SequenceError, match="period: must be >= 0, got -1"):
        Warmup(0.0, -1, then=then)


@pytest.mark.parametrize(
    "tuned",
    [
        {"kind": "multistep", "init": 1.0, "milestones": [1, 2, 3], "gamma": 1e300},  # init * gamma**2
        {"kind": "multistep", "init": 1e300, "milestones": [1], "gamma": 1e10},  # inf from a product
        {"kind": "warmup", "init": -1e308, "period": 1, "then": 1e308},  # the slope, then a one-step ramp
        {"kind": "warmup", "init": -(10**400), "period": 5, "then": 1.0},  # an int past a float
        {"kind": "multistep", "init": 10**400, "milestones": [5], "gamma": 0.5},  # an int times a float
        [[0, 1, "cosine", ["float", -1e308, 1e308, 1, 1.0]], [1, None, "const", ["float", 1.0]]],  # hi - lo
    ],
)
def test_a_value_past_a_floats_range_is_a_sequence_error_saying_so(tuned: object) -> None:
    with pytest.raises(SequenceError, match=OVERFLOW):
        Config.of({"lr": tuned})


def test_a_power_past_a_floats_range_is_neither_computed_nor_a_continuation() -> None:
    # an int gamma is exact: 10 ** 2**62 would never finish, so it is refused as the float's overflow is
    long = 2**62
    segs = [[0, long, "exp", ["int", 1, 10]], [long, None, "exp", ["int", 1, 10]]]
    assert len(Config.of({"lr": segs}).items[0][1]) == 2  # not merged: no finite value carries it on
    floats = [[0, 1000, "step", ["float", 1.0, 1, 10.0]], [1000, None, "step", ["float", 1.0, 1, 10.0]]]
    assert len(Config.of({"lr": floats}).items[0][1]) == 2
    with pytest.raises(SequenceError, match=OVERFLOW):
        value_at(Exponential(0.1, 1.01).segments(), 10**6)
    with pytest.raises(SequenceError, match=OVERFLOW):
        value_at(segments_from_json(segs), 400)
    # a value past the range compares with nothing: two schedules part there, nothing raises
    grows, other = Exponential(1.0, 10.0).segments(), Linear(1.0, 9.0).segments()
    assert first_divergence(grows, other, 0, 10**6) == 2
    same_start = Piecewise([Exponential(1.0, 10.0), 0.5], [400]).segments()
    assert first_divergence(grows, same_start, 0, 10**6) == 400  # equal pieces to 400, then 10.0**400 vs 0.5


def _cosine_place_one_by_one(u: int, period: float, mult: float) -> tuple[int, int]:
    length = period
    while u >= length:
        u -= length
        period = period * mult
        length = max(1, round(period))
    return u, int(length)


@given(
    st.integers(0, 5_000),
    st.integers(1, 50),
    st.one_of(st.sampled_from([1, 1.0, 0.0, 0.5, -1.0, -0.5, 2.0, 1.5]), st.floats(-3, 3)),
)
def test_a_cosine_places_a_step_in_its_cycle_as_walking_its_restarts_does(u: int, period: int, mult: float) -> None:
    assert _cosine_place(u, period, mult) == _cosine_place_one_by_one(u, period, mult)


def test_a_cosine_far_out_is_a_remainder_and_a_gamma_a_hair_from_1_is_refused_there_not_walked() -> None:
    far = 10**15
    assert value_at(Cosine(0.1, 0.0, 7, 1.0).segments(), far) == value_at(Cosine(0.1, 0.0, 7, 1.0).segments(), far % 7)
    assert value_at(Cosine(0.1, 0.0, 7, 0.5).segments(), far) == 0.1  # cycles of one step: each at its start
    with pytest.raises(SequenceError, match="warm restarts"):
        value_at(Cosine(0.1, 0.0, 1, 1 + 1e-9).segments(), far)
    # two schedules that agree to 10**9 steps and part there: compared there, not walked to
    a = Cosine(0.1, 0.0, 1, 1.0).segments()
    assert first_divergence(a, Piecewise([Cosine(0.1, 0.0, 1, 1.0), 0.5], [10**9]).segments(), 0, far) == 10**9


def _first_divergence_by_definition(a, b, start: int, limit: int) -> int:  # type: ignore[no-untyped-def]
    """``first_divergence`` as its docstring defines it, step by step: equal pieces skipped whole, values
    compared where pieces differ, at most ``LOOKAHEAD`` of them in all (then the search stops there)."""
    from stagetree.core.sequences import LOOKAHEAD, segment_value

    def index(segs, step):  # type: ignore[no-untyped-def]
        return max(i for i, s in enumerate(segs) if s.start <= step or i == 0)

    ia, ib, pos, budget = index(a, start), index(b, start), start, LOOKAHEAD
    while pos < limit:
        sa, sb = a[ia], b[ib]
        ends = [e for e in (sa.end, sb.end) if e is not None]
        end = min(ends) if ends else limit
        if (sa.start, sa.kind, sa.params) == (sb.start, sb.kind, sb.params):
            if not ends:
                return limit
            pos = end
        else:
            stop = min(end, limit, pos + budget)
            for s in range(pos, stop):
                try:
                    va, vb = segment_value(sa, s), segment_value(sb, s)
                except SequenceError:
                    return s
                if va != vb or type(va) is not type(vb):
                    return s
            budget -= stop - pos
            pos = stop
            if pos < min(end, limit):
                return pos
        ia += sa.end == pos
        ib += sb.end == pos
    return limit


@st.composite
def raw_pieces(draw: st.DrawFn) -> tuple[Segment, ...]:
    """Pieces as no family writes them, so that equal values sit in pieces that differ, stretch after
    stretch: constants of one value cut at different steps, and flat lines (slope 0) beside them."""
    cuts = sorted(set(draw(st.lists(st.integers(min_value=1, max_value=180), max_size=4))))
    bounds = [0, *cuts, None]
    out = []
    for lo, hi in itertools.pairwise(bounds):
        v = draw(st.sampled_from([0.1, 0.05]))
        kind, params = draw(st.sampled_from([("const", ("float", v)), ("linear", ("float", v, 0.0))]))
        out.append(Segment(lo, hi, kind, params))
    return tuple(out)


def test_the_look_ahead_budget_spans_the_differing_stretches() -> None:
    flat = Constant(0.1).segments()
    # equal values in differing pieces for 40 steps, equal pieces, then again: the budget of 64 ends 24
    # steps into the second stretch
    b = (
        Segment(0, 40, "linear", ("float", 0.1, 0.0)),
        Segment(40, 100, "const", ("float", 0.1)),
        Segment(100, None, "linear", ("float", 0.1, 0.0)),
    )
    a = (
        Segment(0, 40, "const", ("float", 0.1)),
        Segment(40, 100, "const", ("float", 0.1)),
        Segment(100, None, "const", ("float", 0.1)),
    )
    assert first_divergence(a, b, 0, 500) == _first_divergence_by_definition(a, b, 0, 500) == 100 + (64 - 40)
    assert first_divergence(flat, b, 0, 500) == 64


@given(
    st.one_of(sequences(), raw_pieces()),
    st.one_of(sequences(), raw_pieces()),
    st.integers(min_value=0, max_value=150),
    st.integers(min_value=0, max_value=200),
)
def test_first_divergence_is_its_definition(a, b, start, limit) -> None:  # type: ignore[no-untyped-def]
    # A plan stored in the database was cut where this function said: a faster one must say the same, or a
    # trial submitted again would walk to another node. (Constants that meet after different pieces, as
    # a warmup's end and a flat schedule do, take the one-comparison path; budgets run out in both.)
    sa = a if isinstance(a, tuple) else a.segments()
    sb = b if isinstance(b, tuple) else b.segments()
    assert first_divergence(sa, sb, start, limit) == _first_divergence_by_definition(sa, sb, start, limit)
    flat = Constant(0.1).segments()
    assert first_divergence(flat, sb, start, limit) == _first_divergence_by_definition(flat, sb, start, limit)
