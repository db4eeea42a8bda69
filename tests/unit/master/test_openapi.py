"""The REST spec's schemas of the core's JSON (``master.api.openapi``) against the core itself: every
sequence family has a schema, and what the core writes (``to_json``) is valid under it, so the spec cannot
fall behind a new family or field."""

from __future__ import annotations

from typing import Any

import jsonschema_rs  # schemathesis's validator (the dev extra)
import pytest

from stagetree.core import sequences as s
from stagetree.core.config import FixedPart
from stagetree.master.api.openapi import COMPONENTS, FAMILIES, NON_FINITE

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
