"""``CifarResNet``: a small ResNet on CIFAR-10-shaped data that the trainer generates (nothing downloads).

The GPU example and the trainer of the GPU bench (``tests.bench.gpu``): a ``TorchTrainer`` whose model
is a ResNet of basic blocks (a 3x3 stem, three stages of ``width``, ``2 width`` and ``4 width`` channels,
strides 1 / 2 / 2, a global mean and a linear head) over 32x32 RGB images of 10 classes.

The data stands in for CIFAR-10 with its shapes and a learnable signal: each class has a smooth random
template (an 8x8x3 pattern, each pixel repeated 4x4), an image is its class's template plus unit
Gaussian noise, and labels are uniform. It is drawn from a ``torch.Generator`` seeded by ``data_seed``
on the CPU, so every process (a resumed batch on another node manager, a straight reference run) builds
exactly the same rows, then moved to the trainer's device.

Fixed values (all optional): ``width`` (16), ``blocks`` per stage (1), ``train_rows`` (8192),
``eval_rows`` (1024), ``data_seed`` (0), ``batch_size`` (128), ``minibatches`` per step (1) and
``deterministic`` (true). Tuned: what ``TorchTrainer`` applies (``lr``, ``momentum``, ``weight_decay``,
``batch_size``).

With ``deterministic`` the trainer asks PyTorch for deterministic algorithms (cuDNN's deterministic
convolutions, cuBLAS with a fixed workspace: ``CUBLAS_WORKSPACE_CONFIG``, which the node manager sets
for GPU workers), and every op it uses has a deterministic CUDA implementation: the global pooling is
a mean (adaptive average pooling's CUDA backward is not deterministic) and the loss is computed from a
one-hot product (no scatter in the backward). A batch resumed from a checkpoint on CUDA then trains
bit for bit what the uninterrupted run trains (``tests.bench.gpu`` checks the saved states are equal).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stagetree.core.batch import BatchSpec, Point, Source
from stagetree.nodemanager.examples.digits import digits_batch
from stagetree.nodemanager.runtime.torch_trainer import TorchTrainer
from stagetree.nodemanager.slots import CUBLAS_WORKSPACE

ENTRY_POINT = "stagetree.nodemanager.examples.cifar:CifarResNet"
DATASET = "synthetic-cifar10"
CLASSES = 10


def synthetic_cifar(rows: int, seed: int, *, split: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)``: ``rows`` images of shape (3, 32, 32) as float32 and their int64 labels.
    The class templates depend on ``seed`` only; ``split`` draws other rows of the same classes (the
    evaluation set is ``split=1``)."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(CLASSES, 3, 8, 8, generator=g).repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)
    g.manual_seed(seed * 7919 + 104729 * (split + 1))
    labels = torch.randint(0, CLASSES, (rows,), generator=g)
    images = templates[labels] * 0.6 + torch.randn(rows, 3, 32, 32, generator=g)
    return images, labels


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int = 16, blocks: int = 1, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers: list[nn.Module] = []
        cin = width
        for i, stride in enumerate((1, 2, 2)):
            cout = width * 2**i
            for b in range(blocks):
                layers.append(BasicBlock(cin, cout, stride if b == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.stages(self.stem(x))
        logits: torch.Tensor = self.head(out.mean(dim=(2, 3)))  # a mean, not AdaptiveAvgPool2d: deterministic on CUDA
        return logits


def use_deterministic_algorithms() -> None:
    """Deterministic kernels from here on (call before the first CUDA op of the process)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


class CifarResNet(TorchTrainer):
    batch_size = 128

    def init(self) -> None:
        if bool(self.fixed.get("deterministic", True)):
            use_deterministic_algorithms()
        super().init()

    def make_model(self) -> nn.Module:
        return ResNet(int(self.fixed.get("width", 16)), int(self.fixed.get("blocks", 1)))

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def make_data(self) -> tuple[Any, Any]:
        seed = int(self.fixed.get("data_seed", 0))
        train = synthetic_cifar(int(self.fixed.get("train_rows", 8192)), seed)
        evaluation = synthetic_cifar(int(self.fixed.get("eval_rows", 1024)), seed, split=1)
        return train, evaluation

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # cross-entropy through a one-hot product: its backward has no scatter (deterministic on CUDA)
        one_hot = F.one_hot(target, output.shape[1]).to(output.dtype)
        return -(F.log_softmax(output, dim=1) * one_hot).sum(dim=1).mean()


def cifar_batch(
    batch_id: int,
    start: int,
    end: int,
    hps: Mapping[str, Any],
    fixed: Mapping[str, Any],
    *,
    source_uri: str | None = None,
    save: bool = True,
    evaluate: bool = True,
    seed: int = 0,
) -> BatchSpec:
    """A batch of ``CifarResNet`` training node 1 from ``start`` to ``end`` with ``hps`` (from a fresh model
    at step 0, else from the checkpoint ``source_uri`` at ``start``); a checkpoint and an evaluation at
    ``end`` unless told otherwise. Tests and the GPU bench build theirs with it."""
    return digits_batch(
        [(1, start, end, hps)],
        batch_id=batch_id,
        seed=seed,
        trainer=ENTRY_POINT,
        dataset=DATASET,
        fixed_values=fixed,
        source=Source(Point(1, start), source_uri) if source_uri is not None else None,
        saves=[(1, end)] if save else [],
        evals=[(1, end)] if evaluate else [],
    )
