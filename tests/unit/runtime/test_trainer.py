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
from stagetree.nodemanager.runtime.trainer import (
    TrainerContext,
    capture_rng_state,
    load_trainer_class,
    restore_rng_state,
    seed_everything,
)


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


class _Noisy(DigitsMLP):
    """A trainer whose cached value draws random numbers while it is built."""

    builds = 0

    def init(self) -> None:
        def build() -> torch.Tensor:
            type(self).builds += 1
            return torch.rand(4)

        self.data = self.cached("noise", build)
        super().init()


def _bound(cls: type[DigitsMLP], **fixed: object) -> DigitsMLP:
    trainer = cls()
    trainer.bind(TrainerContext(fixed=fixed, seed=3))
    return trainer


def test_cached_keeps_a_value_per_fixed_part_and_leaves_the_random_streams_alone() -> None:
    _Noisy.builds = 0
    a = _bound(_Noisy, hidden=8)
    seed_everything(3)
    a.init()
    after_build = _draw()
    b = _bound(_Noisy, hidden=8)
    seed_everything(3)
    b.init()
    after_kept = _draw()
    assert _Noisy.builds == 1 and b.data is a.data  # kept for the same fixed part
    assert after_kept == after_build  # the build's draws did not move the streams the trainer uses
    c = _bound(_Noisy, hidden=16)
    seed_everything(3)
    c.init()
    assert _Noisy.builds == 2 and c.data is not a.data  # another fixed part: built again ...
    d = _bound(_Noisy, hidden=8)
    seed_everything(3)
    d.init()
    assert _Noisy.builds == 3  # ... and only one fixed part's values are kept at a time
    assert torch.equal(d.data, a.data)  # built from the same streams, the same value


def test_seed_everything_seeds_every_stream_the_same_way_each_time() -> None:
    seed_everything(11)
    first = (random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.randn(2).tolist())
    random.random(), np.random.rand(), torch.rand(5)  # the streams move on ...
    seed_everything(11)
    assert (random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.randn(2).tolist()) == first
    torch.manual_seed(11)  # ... and torch's CPU stream is torch.manual_seed's
    assert torch.rand(3).tolist() == first[2]
