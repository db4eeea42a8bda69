"""``TorchTrainer``: the hyper-parameters it applies, its errors, and exact resume through ``run_batch``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn

import stagetree
from stagetree.core.batch import Point, Source
from stagetree.core.errors import InvalidArgument
from stagetree.core.sequences import MultiStep, Warmup
from stagetree.nodemanager.examples.digits import digits_batch
from stagetree.nodemanager.examples.torch_digits import ENTRY_POINT, DigitsTorch
from stagetree.nodemanager.runtime.executor import new_trainer, run_batch
from stagetree.nodemanager.runtime.trainer import TrainerContext, load_trainer_class

FIXED = {"dropout": 0.2, "hidden": 32}  # dropout: the torch RNG must be restored too
HP: dict[str, Any] = {
    "lr": Warmup(0.02, 3, MultiStep(0.2, [12], 0.5)),
    "momentum": 0.9,
    "weight_decay": MultiStep(0.0, [9], 1e-4),
    "batch_size": MultiStep(16, [15], 2),
}


def _run(spec: Any, store: Any, events: Any, trainer: Any = DigitsTorch) -> None:
    outcome = run_batch(spec, trainer, store, events)
    assert outcome.status == "finished", events.of("batch_failed")


def test_top_level_exports_and_entry_point() -> None:
    assert stagetree.TorchTrainer is DigitsTorch.__mro__[1]
    assert issubclass(stagetree.TorchTrainer, stagetree.Trainer)
    assert load_trainer_class(ENTRY_POINT) is DigitsTorch
    assert "TorchTrainer" in dir(stagetree) and "Trainer" in stagetree.__all__


def test_straight_run_equals_stop_and_resume_across_schedule_changes(store, make_events) -> None:
    straight = make_events()
    _run(digits_batch([(1, 0, 24, HP)], fixed_values=FIXED, evals=[(1, 24)], trainer=ENTRY_POINT), store, straight)

    head = make_events()
    spec = digits_batch([(1, 0, 10, HP)], fixed_values=FIXED, saves=[(1, 10)], batch_id=2, trainer=ENTRY_POINT)
    _run(spec, store, head)
    uri = head.checkpoint_at(10)["uri"]
    torch.manual_seed(123)  # whatever the process did in between must not matter
    tail = make_events()
    spec = digits_batch(
        [(1, 10, 24, HP)],
        fixed_values=FIXED,
        source=Source(Point(1, 10), uri),
        evals=[(1, 24)],
        batch_id=3,
        trainer=ENTRY_POINT,
    )
    _run(spec, store, tail)
    assert tail.metrics_at(24) == straight.metrics_at(24)  # bit for bit
    assert set(straight.metrics_at(24)) == {"accuracy", "loss"}
    assert straight.metrics_at(24)["accuracy"] > 0.5  # it learns: not two untrained models compared


def _trainer(cls: type[stagetree.TorchTrainer] = DigitsTorch, **fixed: Any) -> Any:
    t = cls()
    t.bind(TrainerContext(fixed=fixed, seed=0))
    t.init()
    return t


def test_applies_optimizer_and_loader_hyper_parameters_and_train_returns_the_loss() -> None:
    t = _trainer(minibatches=2)
    t.setup({"lr": 0.05, "momentum": 0.8, "weight_decay": 1e-3, "bs": 8})
    g = t.optimizer.param_groups[0]
    assert (g["lr"], g["momentum"], g["weight_decay"], t.loader.batch_size) == (0.05, 0.8, 1e-3, 8)
    before = t.loader.cursor
    out = t.train()
    assert set(out) == {"loss"} and out["loss"] > 0 and t.loader.cursor == before + 16


class _AdamDigits(DigitsTorch):
    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-3)


def test_betas_are_tuned_one_by_one_and_wrong_names_say_what_to_do() -> None:
    t = _trainer(_AdamDigits)
    t.setup({"beta1": 0.8, "beta2": 0.99, "batch_size": 64})
    assert t.optimizer.param_groups[0]["betas"] == (0.8, 0.99) and t.loader.batch_size == 64
    with pytest.raises(InvalidArgument, match="Adam has no 'momentum'"):
        t.setup({"momentum": 0.9})
    with pytest.raises(InvalidArgument, match="override apply_hp"):
        t.setup({"dropout": 0.1})
    with pytest.raises(InvalidArgument, match="SGD has no betas"):
        _trainer().setup({"beta1": 0.9})


class _BadData(DigitsTorch):
    def make_data(self) -> tuple[Any, Any]:
        return [1, 2, 3], None


def test_bad_data_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgument, match="make_data must return"):
        new_trainer(_BadData, digits_batch([(1, 0, 1, {"lr": 0.1})]).fixed, torch.device("cpu"))
