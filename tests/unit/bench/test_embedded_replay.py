"""The embedded bench's replay of a real run's tuner decisions in the simulator (a pure function of the
trace): a group of submits waits for every result the real tuner had seen before making it."""

from __future__ import annotations

from typing import Any

from stagetree.client.tuners.base import Result, Start, Submit
from tests.bench.embedded import ReplayDriver

CFG: dict[str, Any] = {"lr": 0.1}


def _submit(trial: int, step: int) -> Submit:
    return Submit(trial_id=trial, config=CFG, step=step)


def _result(trial: int, step: int) -> Result:
    return Result(trial_id=trial, step=step, metrics={"acc": 0.5})


def test_a_rung_is_released_only_when_every_result_before_it_is_in_whatever_their_order() -> None:
    # real run: trials 1, 2, 3 to step 10; after the last of their results, 1 and 2 go on to step 30,
    # and after trial 1's step-30 result, trial 1 goes to step 90
    trace: list[tuple[object, list[Any]]] = [
        (Start(), [_submit(1, 10), _submit(2, 10), _submit(3, 10)]),
        (_result(1, 10), []),
        (_result(2, 10), []),
        (_result(3, 10), [_submit(1, 30), _submit(2, 30)]),
        (_result(1, 30), []),
        (_result(2, 30), [_submit(1, 90)]),
    ]
    r = ReplayDriver(trace)
    assert [a.tag for a in r.start()] == [(1, 10), (2, 10), (3, 10)]
    # the simulator delivers them in another order: trial 3 first
    assert r.on_result((3, 10), 10, {}) == []  # the real tuner had not decided anything on this alone
    assert r.on_result((1, 10), 10, {}) == []
    assert [a.tag for a in r.on_result((2, 10), 10, {})] == [(1, 30), (2, 30)]  # the whole rung is in
    assert r.on_result((2, 30), 30, {}) == []
    assert [a.tag for a in r.on_result((1, 30), 30, {})] == [(1, 90)]
    assert [a.step for a in r.start()] == [10, 10, 10]  # start() does not consume anything
