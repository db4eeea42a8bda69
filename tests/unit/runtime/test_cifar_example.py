"""The GPU example trainer (``examples/cifar.py``) on the CPU: its generated data, its loss, and an exact
resume through the runtime (the same check runs on CUDA in test_cuda.py and tests.bench.gpu)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from stagetree.nodemanager.examples import cifar
from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
from stagetree.nodemanager.runtime.executor import run_batch
from stagetree.nodemanager.runtime.trainer import TrainerContext
from tests.gpu_workers import checkpoint_state, differences

FIXED = {"width": 4, "train_rows": 96, "eval_rows": 32, "batch_size": 16, "minibatches": 2}


@pytest.fixture(autouse=True)
def deterministic_mode_restored() -> Iterator[None]:
    """The trainer turns deterministic algorithms on for its process: give the test process's back."""
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic = before[1]
    if env is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def test_generated_data_is_the_same_for_a_seed_and_learnable() -> None:
    x1, y1 = cifar.synthetic_cifar(64, seed=3)
    x2, y2 = cifar.synthetic_cifar(64, seed=3)
    assert x1.shape == (64, 3, 32, 32) and y1.dtype == torch.int64 and int(y1.max()) < cifar.CLASSES
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    xe, _ye = cifar.synthetic_cifar(64, seed=3, split=1)
    assert not torch.equal(xe, x1)
    # the same class templates in both splits: a class's mean image is close across splits
    big_x, big_y = cifar.synthetic_cifar(2000, seed=3)
    ev_x, ev_y = cifar.synthetic_cifar(2000, seed=3, split=1)
    a, b = big_x[big_y == 0].mean(0), ev_x[ev_y == 0].mean(0)
    other = big_x[big_y == 1].mean(0)
    assert (a - b).abs().mean() < (a - other).abs().mean() / 2


def test_the_one_hot_loss_is_cross_entropy() -> None:
    t = cifar.CifarResNet()
    out, target = torch.randn(8, 10), torch.randint(0, 10, (8,))
    assert torch.allclose(t.loss(out, target), F.cross_entropy(out, target), atol=1e-6)


def test_resnet_widths_and_blocks() -> None:
    net = cifar.ResNet(width=4, blocks=2)
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert len(net.stages) == 6 and net.head.in_features == 16


def test_deterministic_is_the_default_and_can_be_turned_off() -> None:
    t = cifar.CifarResNet()
    t.bind(TrainerContext(fixed={**FIXED, "deterministic": False}))
    t.init()
    assert not torch.are_deterministic_algorithms_enabled()
    t = cifar.CifarResNet()
    t.bind(TrainerContext(fixed=FIXED))
    t.init()
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def _spec(batch_id: int, start: int, end: int, source_uri: str | None = None) -> Any:
    return cifar.cifar_batch(batch_id, start, end, {"lr": 0.05, "momentum": 0.9}, FIXED, source_uri=source_uri)


def test_resumed_run_equals_the_straight_one(store: LocalCheckpointStore, make_events: Any) -> None:
    straight, first, second = make_events(), make_events(), make_events()
    assert run_batch(_spec(1, 0, 5), cifar.CifarResNet, store, straight, background_saves=False).status == "finished"
    assert run_batch(_spec(2, 0, 2), cifar.CifarResNet, store, first, background_saves=False).status == "finished"
    resume = _spec(3, 2, 5, first.checkpoint_at(2)["uri"])
    assert run_batch(resume, cifar.CifarResNet, store, second).status == "finished"
    a = checkpoint_state(store.root, straight.checkpoint_at(5)["uri"])
    b = checkpoint_state(store.root, second.checkpoint_at(5)["uri"])
    assert differences(a, b) == []
    assert straight.metrics_at(5) == second.metrics_at(5)
    assert differences(a, checkpoint_state(store.root, first.checkpoint_at(2)["uri"]))  # the check can fail
