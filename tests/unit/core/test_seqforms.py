"""One printed and one JSON form per schedule (``core.seqforms``): a schedule submitted, stored as segments,
loaded back and printed reads as the family call it was written with, and that text parses to it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.config import Config
from stagetree.core.errors import SequenceError
from stagetree.core.seqforms import config_family_json, config_text, family_of, parse_text, to_family_json, to_text
from stagetree.core.sequences import (
    Constant,
    Cosine,
    CyclicLR,
    Exponential,
    Linear,
    MultiStep,
    Piecewise,
    Sequence,
    Step,
    Warmup,
    from_json,
    segments_from_json,
)

rates = st.sampled_from([0.1, 0.05, 0.01, 0.001, 0.3, 1.0, 0.0125, 2e-4])
gammas = st.sampled_from([0.1, 0.5, 0.9, 0.95, 0.98, 2.0])
steps = st.integers(1, 60)


def _base() -> st.SearchStrategy[Sequence]:
    return st.one_of(
        rates.map(Constant),
        st.sampled_from([16, 32, 64]).map(Constant),
        st.sampled_from(["adam", "sgd"]).map(Constant),
        st.builds(Linear, rates, st.sampled_from([0.001, -0.0005, 0.01])),
        st.builds(Exponential, rates, gammas),
        st.builds(Step, rates, steps, gammas),
        st.builds(MultiStep, rates, st.lists(steps, min_size=1, max_size=3, unique=True).map(sorted), gammas),
        st.builds(Cosine, rates, st.sampled_from([0.0, 0.001]), steps, st.sampled_from([1.0, 2.0])),
        st.builds(CyclicLR, st.sampled_from([0.001, 0.01]), st.sampled_from([0.1, 0.05]), steps, steps),
    )


def _numeric(s: Sequence) -> bool:
    return not isinstance(s.value(0), str | bool)


schedules: st.SearchStrategy[Sequence] = st.recursive(
    _base(),
    lambda inner: st.one_of(
        st.builds(Warmup, st.sampled_from([0.0, 0.001, 0.01]), steps, inner.filter(_numeric)),
        st.lists(inner, min_size=2, max_size=3).flatmap(
            lambda pieces: st.lists(steps, min_size=len(pieces) - 1, max_size=len(pieces) - 1, unique=True).map(
                lambda bs: Piecewise(pieces, sorted(bs))
            )
        ),
    ),
    max_leaves=4,
)


def _loaded(seq: Sequence) -> Sequence:
    """The schedule as a loaded study sees it: submitted as JSON, stored as segments, read from the plan."""
    wire = json.dumps({"lr": seq.to_json()})
    stored = json.dumps(Config.of(json.loads(wire)).to_json())
    return Config.from_json(json.loads(stored)).sequence("lr")


@settings(max_examples=300, deadline=None)
@given(schedules)
def test_submit_load_print_parse_round_trips(seq: Sequence) -> None:
    loaded = _loaded(seq)
    assert loaded == seq
    assert repr(loaded) == repr(seq) == str(seq) == to_text(seq)  # fresh and loaded read the same
    assert parse_text(repr(loaded)) == seq
    assert from_json(to_family_json(loaded)) == seq
    assert to_family_json(loaded) == to_family_json(seq)
    assert "Segments(" not in repr(loaded)  # every family's schedule reads as a family


@settings(max_examples=200, deadline=None)
@given(schedules)
def test_the_recovered_family_gives_back_the_very_segments(seq: Sequence) -> None:
    assert family_of(seq.segments()).segments() == seq.segments()


def test_a_constant_reads_as_its_number_in_every_form() -> None:
    c = Config.from_json({"bs": [[0, None, "const", ["int", 16]]]})
    assert repr(c.sequence("bs")) == "16" and to_family_json(c.sequence("bs")) == 16
    assert config_text({"bs": c.sequence("bs"), "lr": Warmup(0.01, 5, Cosine(0.1, 0.001, 40))}) == (
        "bs=16 lr=Warmup(0.01, 5, then=Cosine(0.1, 0.001, 40))"
    )


def test_configs_in_any_of_their_json_forms_read_the_same() -> None:
    seq = Warmup(0.01, 5, Cosine(0.1, 0.001, 40))
    forms = [seq, seq.to_json(), Config.of({"lr": seq}).to_json()["lr"], to_family_json(seq)]
    assert {config_text({"lr": f}) for f in forms} == {"lr=Warmup(0.01, 5, then=Cosine(0.1, 0.001, 40))"}
    assert config_family_json({"lr": forms[2]}) == {
        "lr": {"kind": "warmup", "init": 0.01, "period": 5, "then": {"kind": "cosine", "init": 0.1,
               "min_value": 0.001, "period": 40}}
    }  # fmt: skip


def test_segments_no_family_builds_still_print_and_parse() -> None:
    segs = segments_from_json([[0, None, "linear", ["int", 1, 0.5]]])
    assert family_of(segs).segments() == segs
    odd = segments_from_json([[0, 3, "cosine", ["int", 8, 2, 4, 1.0]], [3, None, "const", ["int", 2]]])
    text = to_text(odd)
    assert parse_text(text).segments() == odd


@pytest.mark.parametrize(
    "text",
    ["__import__('os').system('true')", "Warmup(0.01, 5, then=open('x'))", "lambda: 1", "Nope(1)", "", "[1, 2]"],
)
def test_parsing_reads_family_calls_and_literals_only(text: str) -> None:
    with pytest.raises(SequenceError):
        parse_text(text)
