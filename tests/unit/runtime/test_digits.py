"""The digits example: the same data as scikit-learn's loader, and fast enough for tests and benches."""

from __future__ import annotations

import time

import numpy as np
import torch

from stagetree.core.sequences import Value
from stagetree.nodemanager.examples.digits import DigitsMLP, digits_split, load_digits_arrays
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
