"""The REST spec's schemas of the core's JSON (``master.api.openapi``) against the core itself: every
sequence family has a schema, and what the core writes (``to_json``) is valid under it, so the spec cannot
fall behind a new family or field."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema_rs  # schemathesis's validator (the dev extra)
import pytest

from stagetree.core import sequences as s
from stagetree.core.config import FixedPart
from stagetree.core.errors import InvalidArgument, SequenceError
from stagetree.core.policies.study import POLICY_NAMES, parse_policies
from stagetree.master.api.openapi import COMPONENTS, CROSS_ITEM_RULES, FAMILIES, NON_FINITE

EXAMPLES = [
    s.Constant(0.1),
    s.Constant("adam"),
    s.Linear(0.1, -0.001),
    s.Exponential(0.1, 0.9),
    s.Step(0.1, 10, 0.5),
    s.MultiStep(0.1, [5, 9], 0.5),
    s.Cosine(0.1, 0.0, 20, 2.0),
    s.CyclicLR(0.01, 0.1, 4, 6),
    s.Warmup(0.0, 5, s.Cosine(0.1, 0.0, 20)),
    s.Piecewise([0.1, s.Exponential(0.1, 0.9)], [10]),
    s.as_sequence(
        {"kind": "segments", "segments": [[0, 10, "const", ["float", 0.1]], [10, None, "const", ["float", 0.2]]]}
    ),
]


def _validator(name: str) -> Any:
    return jsonschema_rs.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": {"schemas": COMPONENTS}}
    )


def test_every_family_of_the_core_has_a_schema() -> None:
    assert set(FAMILIES) == set(s._FAMILIES)
    assert {type(x).family for x in EXAMPLES} == set(FAMILIES)


@pytest.mark.parametrize("seq", EXAMPLES, ids=lambda x: type(x).family)
def test_what_the_core_writes_is_valid_under_the_spec(seq: s.Sequence) -> None:
    v = _validator("Sequence")
    assert v.is_valid(seq.to_json()), list(v.iter_errors(seq.to_json()))
    assert v.is_valid([x.to_json() for x in seq.segments()])  # the canonical form plan views give
    config = {"fixed": FixedPart("m:Net", "d", "m", 1, {"wd": 0.1}, "v1").to_json(), "tuned": {"lr": seq.to_json()}}
    assert _validator("TrialConfig").is_valid(config)


def test_the_spec_refuses_what_is_not_a_sequence_and_declares_non_finite_metrics() -> None:
    v = _validator("Sequence")
    assert not v.is_valid({"kind": "exponential", "init": 0.1})  # gamma missing
    assert not v.is_valid({"kind": "nope"})
    assert not v.is_valid(None)
    m = _validator("MetricValue")
    assert all(m.is_valid(x) for x in (0.5, *NON_FINITE)) and not m.is_valid("nan")


def test_a_studys_fixed_part_may_name_its_policies_a_trials_may_not() -> None:
    fixed = FixedPart("m:Net").to_json()
    assert _validator("StudyFixed").is_valid({**fixed, "policies": {"time_share": "hermes"}})
    assert not _validator("StudyFixed").is_valid({**fixed, "policies": {"preempt": "hermes"}})
    assert not _validator("FixedPart").is_valid({**fixed, "policies": {}})
    assert not _validator("FixedPart").is_valid({**fixed, "typo": 1})


def test_a_schedule_inside_another_is_a_value_or_a_family_and_a_warmup_ramps_into_a_number() -> None:
    seq, piece, numeric = _validator("Sequence"), _validator("Piece"), _validator("NumericPiece")
    segments = [[0, None, "const", ["float", 0.1]]]
    assert seq.is_valid(segments) and not piece.is_valid(segments)  # the core reads a bare list at the top only
    with pytest.raises(SequenceError):
        s.from_json({"kind": "piecewise", "pieces": [segments], "boundaries": []})
    warmup = {"kind": "warmup", "init": 0.0, "period": 5}
    for then in (
        "adam",
        True,
        {"kind": "constant", "value": "adam"},
        {"kind": "piecewise", "pieces": ["a"], "boundaries": []},
    ):
        assert piece.is_valid(then) and not numeric.is_valid(then)
        assert not seq.is_valid({**warmup, "then": then})
        with pytest.raises(SequenceError, match="must be numeric"):
            s.from_json({**warmup, "then": then})
    str_first = {"kind": "segments", "segments": [[0, None, "const", ["str", "a"]]]}
    assert piece.is_valid(str_first) and not numeric.is_valid(str_first)
    numbers: tuple[Any, ...] = (
        0.1,
        s.Cosine(0.1, 0.0, 20).to_json(),
        s.Piecewise([0.1, "a"], [3]).to_json(),
        s.Warmup(0.0, 0, s.Constant(0.1)).to_json(),
    )
    for then in numbers:
        assert numeric.is_valid(then) and seq.is_valid({**warmup, "then": then})
        s.from_json({**warmup, "then": then})
    numeric_first = s.as_sequence(
        {"kind": "segments", "segments": [[0, 3, "linear", ["float", 0.0, 0.1]], [3, None, "const", ["str", "a"]]]}
    )
    assert numeric.is_valid(numeric_first.to_json())


def test_rules_between_items_are_in_words_each_with_the_phrase_of_the_servers_refusal() -> None:
    words = json.dumps(COMPONENTS)
    for said in ("strictly increasing", "one boundary fewer than pieces", "cover [0, forever)", "float's range"):
        assert said in words, said
    refusals: dict[str, Callable[[], object]] = {
        "steps strictly increasing": lambda: s.MultiStep(0.1, [5, 5], 0.5),
        "one boundary fewer than pieces": lambda: s.Piecewise([0.1, 0.2], [3, 4]),
        "segments cover [0, forever)": lambda: s.segments_from_json([[1, None, "const", ["float", 0.1]]]),
        "values within a float's range": lambda: s.MultiStep(1.0, [1, 2], 1e300).segments(),
    }
    assert set(refusals) == set(CROSS_ITEM_RULES)
    for rule, refuse in refusals.items():
        with pytest.raises(SequenceError) as info:
            refuse()
        assert any(p in info.value.message for p in CROSS_ITEM_RULES[rule]), (rule, info.value.message)


def test_a_width_policy_needs_a_qos_class_in_the_spec_as_in_the_core() -> None:
    fixed = FixedPart("m:Net").to_json()
    v = _validator("StudyFixed")
    assert not v.is_valid({**fixed, "policies": {"width": POLICY_NAMES["width"][0]}})
    with pytest.raises(InvalidArgument, match=r"without policies\.qos"):
        parse_policies({"width": POLICY_NAMES["width"][0]})
    both = {"width": POLICY_NAMES["width"][0], "qos": POLICY_NAMES["qos"][0]}
    assert v.is_valid({**fixed, "policies": both}) and parse_policies(both)
