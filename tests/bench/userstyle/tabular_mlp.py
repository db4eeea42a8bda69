"""A user's Optuna module: what ``tests.bench.vs_optuna`` runs as plain Optuna (``tabular_port`` is its
port to stagetree, which stagetree's workers import).

Like Optuna's ``pytorch_simple`` example, with generated tabular data in place of FashionMNIST: an MLP,
SGD with a tuned learning-rate schedule (a warmup, then a decay family), momentum and a batch-size ramp,
accuracy reported at steps 3, 9 and 27 (a step is ``minibatches`` batches) for a median pruner. It
imports what such modules import (optuna, scikit-learn, scipy) at the top, so every process that
imports it pays for them, as a user's workers do.

``objective(trial)`` is the Optuna objective, a plain PyTorch loop.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator
from typing import Any

import optuna
import scipy.stats
import torch
from sklearn.datasets import make_classification
from sklearn.model_selection import train_test_split
from torch import nn

STEPS = 27
RUNGS = (3, 9, 27)
CLASSES = 4
FEATURES = 40
HIDDEN = 128
WARMUP = 5
WARMUP_LR = 0.005
BATCH = 64
MINIBATCHES = int(os.environ.get("TABULAR_MINIBATCHES", "40"))  # batches per step (the step's cost)


@functools.cache
def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = make_classification(
        n_samples=5000, n_features=FEATURES, n_informative=20, n_classes=CLASSES, class_sep=0.8, random_state=0
    )
    x = scipy.stats.zscore(x, axis=0)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0)
    f32 = torch.float32
    return torch.tensor(x_tr, dtype=f32), torch.tensor(y_tr), torch.tensor(x_te, dtype=f32), torch.tensor(y_te)


def model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(HIDDEN, CLASSES),
    )  # fmt: skip


def lr_at(p: dict[str, Any], step: int) -> float:
    peak = p["peak"]
    if step < WARMUP:
        return WARMUP_LR + (peak - WARMUP_LR) * step / WARMUP
    t = step - WARMUP
    if p["decay"] == "cosine":
        return 0.001 + (peak - 0.001) * (1 + math.cos(math.pi * t / (STEPS - WARMUP))) / 2
    if p["decay"] == "exponential":
        return float(peak * p["gamma"] ** t)
    milestones = [int(m) for m in p["milestones"].split(",")]
    return float(peak * 0.3 ** sum(step >= m for m in milestones))


def batches(x: torch.Tensor, y: torch.Tensor, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Minibatches of one reshuffled epoch after another."""
    while True:
        perm = torch.randperm(len(x))
        for i in range(0, len(x), size):
            idx = perm[i : i + size]
            yield x[idx], y[idx]


def objective(trial: optuna.Trial) -> float:
    p: dict[str, Any] = {
        "peak": trial.suggest_float("peak", 0.01, 0.3, log=True),
        "decay": trial.suggest_categorical("decay", ["cosine", "exponential", "multistep"]),
        "momentum": trial.suggest_float("momentum", 0.8, 0.95),
        "ramp": trial.suggest_categorical("ramp", [False, True]),
    }
    if p["decay"] == "exponential":
        p["gamma"] = trial.suggest_categorical("gamma", [0.9, 0.95])
    if p["decay"] == "multistep":
        p["milestones"] = trial.suggest_categorical("milestones", ["10,20", "15,25"])
    x_tr, y_tr, x_te, y_te = data()
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=WARMUP_LR, momentum=p["momentum"])
    loader = batches(x_tr, y_tr, BATCH)
    accuracy = 0.0
    for step in range(STEPS):
        if p["ramp"] and step == 15:
            loader = batches(x_tr, y_tr, BATCH * 2)
        for group in opt.param_groups:
            group["lr"] = lr_at(p, step)
        net.train()
        for _ in range(MINIBATCHES):
            xb, yb = next(loader)
            opt.zero_grad()
            nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
        if step + 1 in RUNGS:
            net.eval()
            with torch.no_grad():
                accuracy = float((net(x_te).argmax(1) == y_te).float().mean())
            trial.report(accuracy, step + 1)
            if trial.should_prune():
                raise optuna.TrialPruned()
    return accuracy
