"""The runtime's RNG checkpointing, trainer entry points, snapshots and the event wire form."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from stagetree.core.errors import InvalidArgument
from stagetree.nodemanager.examples.digits import DigitsMLP
from stagetree.nodemanager.runtime.events import decode_event, encode_event
from stagetree.nodemanager.runtime.state import detached_copy
from stagetree.nodemanager.runtime.trainer import capture_rng_state, load_trainer_class, restore_rng_state


def _draw() -> tuple[float, float, float, list[float]]:
    return random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(3).tolist()


def test_rng_state_survives_a_weights_only_round_trip() -> None:
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = capture_rng_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    expected = _draw()
    buf.seek(0)
    restore_rng_state(torch.load(buf, weights_only=True))
    assert _draw() == expected


def test_trainer_entry_points() -> None:
    assert load_trainer_class("stagetree.nodemanager.examples.digits:DigitsMLP") is DigitsMLP
    for bad in ("nocolon", "stagetree.nodemanager.examples.digits:Missing", "json:JSONDecoder"):
        with pytest.raises(InvalidArgument):
            load_trainer_class(bad)
    with pytest.raises(ModuleNotFoundError):
        load_trainer_class("no_such_module_xyz:T")


def test_detached_copy_shares_no_storage() -> None:
    t = torch.ones(3)
    state = {"a": [t, (t, 1)], "b": {"c": t}, "s": "x"}
    copy = detached_copy(state)
    t.add_(1)
    assert copy["a"][0].tolist() == [1.0, 1.0, 1.0] and copy["b"]["c"].tolist() == [1.0, 1.0, 1.0]
    assert copy["a"][1][1] == 1 and copy["s"] == "x"


def test_event_lines_round_trip_and_are_checked() -> None:
    payload = {
        "batch_id": 1,
        "attempt": 2,
        "node": 3,
        "step": 4,
        "uri": "file:///x",
        "bytes": 5,
        "kind": "central",
        "ranks": 1,
    }
    kind, ts, got = decode_event(encode_event("checkpoint_saved", payload, ts=12.5))
    assert (kind, ts, got) == ("checkpoint_saved", 12.5, payload)
    with pytest.raises(InvalidArgument, match="expected fields"):
        decode_event(encode_event("progress", {"batch_id": 1}))
    with pytest.raises(InvalidArgument, match="unknown event kind"):
        decode_event(encode_event("exploded", {}))
