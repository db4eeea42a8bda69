"""``DigitsTorch``: the digits MLP of ``examples.digits`` written as a ``TorchTrainer`` (three factories).

It trains the same network on the same split as ``DigitsMLP`` and reports ``accuracy`` and ``loss``; it
applies ``lr``, ``momentum``, ``weight_decay`` and ``batch_size`` (or ``bs``) by itself. Fixed values:
``hidden`` (64), ``minibatches`` (1), ``dropout`` (0.0). The Optuna benchmark and the tests use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from stagetree.nodemanager.examples.digits import build_mlp, digits_split
from stagetree.nodemanager.runtime.torch_trainer import TorchTrainer

ENTRY_POINT = "stagetree.nodemanager.examples.torch_digits:DigitsTorch"


class DigitsTorch(TorchTrainer):
    def make_model(self) -> nn.Module:
        return build_mlp(int(self.fixed.get("hidden", 64)), float(self.fixed.get("dropout", 0.0)))

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.0)

    def make_data(self) -> tuple[Any, Any]:
        x_train, y_train, x_test, y_test = digits_split()
        return (x_train, y_train), (x_test, y_test)
