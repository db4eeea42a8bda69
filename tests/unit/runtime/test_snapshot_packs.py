"""A batch's in-memory snapshots of a small model, written as one pack when it ends: every step it trained
is a checkpoint a later trial can branch from, and resuming from one equals a straight run."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from stagetree.core.batch import Point, Source
from stagetree.core.sequences import MultiStep
from stagetree.nodemanager.examples.digits import DigitsMLP, digits_batch
from stagetree.nodemanager.runtime.executor import new_trainer, run_batch
from stagetree.nodemanager.runtime.state import snapshot_bytes, take_snapshot

FIXED = {"dropout": 0.2, "hidden": 32}  # dropout: the RNG state must come back from the pack too
HP: dict[str, Any] = {"lr": MultiStep(0.2, [12], 0.5), "momentum": 0.9, "bs": MultiStep(16, [15], 2)}


def _finished(spec: Any, store: Any, events: Any) -> None:
    outcome = run_batch(spec, DigitsMLP, store, events)
    assert outcome.status == "finished", events.of("batch_failed")


def test_every_step_is_a_checkpoint_and_resuming_from_one_equals_a_straight_run(store, make_events) -> None:
    straight = make_events()
    _finished(digits_batch([(1, 0, 30, HP)], fixed_values=FIXED, evals=[(1, 30)]), store, straight)

    head = make_events()
    spec = digits_batch([(1, 0, 20, HP)], fixed_values=FIXED, saves=[(1, 20)], batch_id=2)
    _finished(dataclasses.replace(spec, snapshot_budget_bytes=64 << 20), store, head)
    saved = head.of("checkpoint_saved")
    packed = [e for e in saved if e["step"] < 20]
    assert [e["step"] for e in packed] == list(range(1, 20))
    assert {e["kind"] for e in packed} == {"peripheral"} and len({e["uri"] for e in packed}) == 1
    assert head.checkpoint_at(20)["kind"] == "central" and head.checkpoint_at(20)["uri"] != packed[0]["uri"]

    for at in (7, 15):  # before and after the batch size changes
        tail = make_events()
        uri = head.checkpoint_at(at)["uri"]
        spec = digits_batch(
            [(1, at, 30, HP)], fixed_values=FIXED, source=Source(Point(1, at), uri), evals=[(1, 30)], batch_id=3 + at
        )
        _finished(spec, store, tail)
        for k, v in straight.metrics_at(30).items():
            assert tail.metrics_at(30)[k] == pytest.approx(v, abs=1e-6), (at, k)


def _one_snapshot_bytes(spec: Any) -> int:
    trainer = new_trainer(DigitsMLP, spec.fixed, torch.device("cpu"))
    trainer.setup({"lr": 0.1, "momentum": 0.9, "bs": 16})
    trainer.train()
    return snapshot_bytes(take_snapshot(trainer, Point(1, 1)))


def test_a_budget_too_small_for_every_step_keeps_every_kth_or_none(store, make_events) -> None:
    spec = digits_batch([(1, 0, 20, HP)], fixed_values=FIXED, saves=[(1, 20)])
    each = _one_snapshot_bytes(spec)
    ev = make_events()
    _finished(dataclasses.replace(spec, snapshot_budget_bytes=each * 20 // 4), store, ev)
    steps = [e["step"] for e in ev.of("checkpoint_saved") if e["step"] < 20]
    assert steps == [1, 4, 8, 12, 16]  # the first (it measures the size), then every 4th
    ev = make_events()
    _finished(dataclasses.replace(spec, snapshot_budget_bytes=each, batch_id=2), store, ev)  # not a small model
    assert [e["step"] for e in ev.of("checkpoint_saved")] == [20]


def test_no_budget_no_pack(store, make_events) -> None:
    ev = make_events()
    _finished(digits_batch([(1, 0, 10, HP)], fixed_values=FIXED, saves=[(1, 10)]), store, ev)
    assert [e["step"] for e in ev.of("checkpoint_saved")] == [10]
