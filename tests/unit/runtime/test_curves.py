"""Learning curves in the worker runtime: what ``train`` returns and ``log`` reports becomes ``curve``
events, one node per event, sampled at the batch's rate, and none lost to the batch's end."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import pytest
import torch

from stagetree.core import batch as batch_module
from stagetree.nodemanager.examples.digits import DigitsMLP, digits_batch
from stagetree.nodemanager.runtime.executor import run_batch
from stagetree.nodemanager.runtime.trainer import StepMetrics

HP: dict[str, Any] = {"lr": 0.1, "momentum": 0.9, "bs": 16}


class Logging(DigitsMLP):
    """Logs a value every step besides what ``train`` returns; NaN at step 4 (dropped, not fatal)."""

    def train(self) -> StepMetrics | None:
        out = super().train()
        self.log(step_seen=float(self.step), odd=math.nan if self.step == 3 else 1.0)
        return out


def _points(events: Any) -> list[tuple[int, int, dict[str, float]]]:
    return [(p["node"], s, v) for p in events.of("curve") for s, v in p["points"]]


def test_every_step_across_stages_one_node_per_event(store, make_events) -> None:
    events = make_events()
    spec = digits_batch([(1, 0, 5, HP), (2, 5, 9, {**HP, "lr": 0.05})])
    assert run_batch(spec, Logging, store, events).status == "finished"
    pts = _points(events)
    assert [(n, s) for n, s, _ in pts] == [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (2, 6), (2, 7), (2, 8), (2, 9)]
    assert all({"train_loss", "step_seen"} <= set(v) for _, _, v in pts)
    assert [v["step_seen"] for _, _, v in pts] == [float(s - 1) for _, s, _ in pts]  # logged during that step
    assert "odd" not in pts[3][2] and pts[4][2]["odd"] == 1.0  # NaN dropped from its point only
    assert all(isinstance(x, float) for _, _, v in pts for x in v.values())
    assert events.kinds()[-1] == "batch_finished"


def test_every_k_steps_and_a_rate_limit(store, make_events, monkeypatch: pytest.MonkeyPatch) -> None:
    events = make_events()
    spec = dataclasses.replace(digits_batch([(1, 0, 12, HP)]), curve_every_steps=4)
    run_batch(spec, DigitsMLP, store, events)
    assert [s for _, s, _ in _points(events)] == [4, 8, 12]

    # a clock that advances 1 s per reading, against a rate of 0.4 points a second
    events = make_events()
    ticks = iter(range(1000))
    spec = dataclasses.replace(digits_batch([(1, 0, 12, HP)]), curve_max_per_s=0.4)
    run_batch(spec, DigitsMLP, store, events, clock=lambda: float(next(ticks)))
    assert [s for _, s, _ in _points(events)] == list(range(1, 13))  # a short batch keeps every step

    monkeypatch.setattr(batch_module, "CURVE_BURST", 3)  # past its first 3 points, the rate applies
    events = make_events()
    ticks = iter(range(1000))
    run_batch(spec, DigitsMLP, store, events, clock=lambda: float(next(ticks)))
    steps = [s for _, s, _ in _points(events)]
    assert steps[:3] == [1, 2, 3] and len(steps) < 12
    assert all(b - a >= 2 for a, b in itertools.pairwise(steps[3:]))

    events = make_events()
    spec = dataclasses.replace(digits_batch([(1, 0, 5, HP)]), curve_every_steps=0)
    run_batch(spec, DigitsMLP, store, events)
    assert events.of("curve") == []


class Fails(DigitsMLP):
    def train(self) -> StepMetrics | None:
        if self.step == 6:
            raise RuntimeError("boom")
        return {"loss": torch.tensor(float(self.step))}


def test_points_before_a_failure_are_kept(store, make_events) -> None:
    events = make_events()
    assert run_batch(digits_batch([(1, 0, 10, HP)]), Fails, store, events).status == "failed"
    assert [s for _, s, _ in _points(events)] == [1, 2, 3, 4, 5, 6]
    assert events.kinds().index("curve") < events.kinds().index("batch_failed")
