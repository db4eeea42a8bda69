"""The digits example: the same data as scikit-learn's loader, and fast enough for tests and benches."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from stagetree.core.sequences import Value
from stagetree.nodemanager.examples.digits import CACHE_ENV, DigitsMLP, digits_split, load_digits_arrays
from stagetree.nodemanager.runtime.trainer import TrainerContext


def test_fast_path_reads_exactly_what_sklearn_loads() -> None:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    fx, fy = load_digits_arrays()
    assert np.array_equal(x, fx) and np.array_equal(y, fy)
    x_train, _, x_test, y_test = digits_split()
    assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
    assert sorted(set(y_test.tolist())) == list(range(10))


def test_learns_and_steps_are_fast() -> None:
    t = DigitsMLP()
    t.bind(TrainerContext(fixed={"minibatches": 2}, seed=0))
    torch.manual_seed(0)
    t.init()
    hps: dict[str, Value] = {"lr": 0.1, "momentum": 0.9, "bs": 32}
    t.setup(hps)
    before = t.evaluate()
    start = time.perf_counter()
    for _ in range(200):
        t.train()
    per_step = (time.perf_counter() - start) / 200
    after = t.evaluate()
    assert after["accuracy"] > 0.9 > before["accuracy"]
    assert after["loss"] < before["loss"]
    assert per_step < 0.02  # a few ms at most, even on a loaded machine


def test_parsed_data_is_cached_and_a_bad_cache_is_parsed_again(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    x, y = load_digits_arrays()
    (cached,) = tmp_path.glob("digits-*.npy")
    cx, cy = load_digits_arrays()  # from the cache now
    assert np.array_equal(x, cx) and np.array_equal(y, cy)
    cached.write_bytes(b"not an array")  # a torn or foreign file: parsed again, and rewritten
    bx, by = load_digits_arrays()
    assert np.array_equal(x, bx) and np.array_equal(y, by)
    assert np.array_equal(np.load(cached)[:, :-1], x)


def test_an_unwritable_cache_directory_still_loads(tmp_path: Any, monkeypatch: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "sub"))  # a directory under a file: cannot be created
    x, y = load_digits_arrays()
    assert x.shape == (1797, 64) and y.shape == (1797,)
