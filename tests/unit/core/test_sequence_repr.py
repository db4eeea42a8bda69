"""Configs print as the constructor calls a user writes (a constant as its value), and read back as the
same schedules."""

from __future__ import annotations

import pytest

from stagetree.core import sequences as sq
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
)

CASES = [
    (Warmup(0.02, 5, Exponential(0.2, 0.98)), "Warmup(0.02, 5, then=Exponential(0.2, 0.98))"),
    (Constant(0.9), "0.9"),
    (Constant(32), "32"),
    (Constant("adam"), "'adam'"),
    (MultiStep(0.1, [30, 60], 0.3), "MultiStep(0.1, [30, 60], 0.3)"),
    (Cosine(0.1, 0.001, 60), "Cosine(0.1, 0.001, 60)"),
    (Cosine(0.1, 0.001, 60, gamma=0.5), "Cosine(0.1, 0.001, 60, gamma=0.5)"),
    (
        Piecewise([Constant(0.1), Exponential(0.1, 0.9)], [10]),
        "Piecewise([0.1, Exponential(0.1, 0.9)], [10])",
    ),
    (Warmup(0.01, 5, Constant(0.05)), "Warmup(0.01, 5, then=0.05)"),
    (  # equal schedules print the same, whichever family wrote them
        Piecewise([Linear(0.01, 0.018), Cosine(0.1, 0.001, 40)], [5]),
        "Warmup(0.01, 5, then=Cosine(0.1, 0.001, 40))",
    ),
]


@pytest.mark.parametrize(("seq", "text"), CASES, ids=[t for _, t in CASES])
def test_a_schedule_prints_as_its_constructor_call(seq: Sequence, text: str) -> None:
    assert repr(seq) == str(seq) == text


@pytest.mark.parametrize(
    "seq",
    [
        *(s for s, _ in CASES),
        Linear(0.1, -0.001),
        Step(0.1, 10, 0.5),
        CyclicLR(0.001, 0.1, 10, 10),
        Warmup(0.0, 3, Piecewise([Cosine(0.1, 0.01, 20), Constant(0.01)], [20])),
    ],
)
def test_the_printed_form_builds_the_same_schedule(seq: Sequence) -> None:
    assert sq.as_sequence(eval(repr(seq), vars(sq))) == seq  # our own repr, in a test; a constant is a value
