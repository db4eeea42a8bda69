"""The port of ``tabular_mlp`` to stagetree, written as docs/integrations.md tells an Optuna user to: the
model as a ``stagetree.TorchTrainer`` (three factories) and the search as an ``OptunaSpace``, with
``grid`` points per float so that prefixes are shared (``grid=None``: the same search with continuous
floats, so nothing is shared). stagetree's workers import this module, and with it everything
``tabular_mlp`` imports.
"""

from __future__ import annotations

from typing import Any

import torch
from tabular_mlp import BATCH, MINIBATCHES, STEPS, WARMUP, WARMUP_LR, data, model
from torch import nn

import stagetree
from stagetree import Choice, Cosine, Exponential, Family, LogUniform, MultiStep, Uniform, Warmup
from stagetree.integrations.optuna import OptunaSpace


class Net(stagetree.TorchTrainer):
    minibatches = MINIBATCHES

    def make_model(self) -> nn.Module:
        return model()

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=WARMUP_LR, momentum=0.9)

    def make_data(self) -> tuple[Any, Any]:
        x_tr, y_tr, x_te, y_te = data()
        return (x_tr, y_tr), (x_te, y_te)


def space(grid: int | None) -> OptunaSpace:
    peak = LogUniform(0.01, 0.3)
    decay = Choice(
        [
            Family(Cosine, init=peak, min_value=0.001, period=STEPS - WARMUP),
            Family(Exponential, init=peak, gamma=Choice([0.9, 0.95])),
            Family(MultiStep, init=peak, milestones=Choice([[10, 20], [15, 25]]), gamma=0.3),
        ]
    )
    return OptunaSpace(
        {
            "lr": Family(Warmup, init=WARMUP_LR, period=WARMUP, then=decay),
            "bs": Choice([BATCH, MultiStep(BATCH, [15], 2)]),
            "momentum": Uniform(0.8, 0.95),
        },
        grid=grid,
    )
