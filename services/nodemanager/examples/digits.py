"""``DigitsMLP``: a small, fast example trainer on scikit-learn's ``load_digits`` (no downloads).

A two-layer MLP trained by SGD with momentum through the resumable loader. Tuned hyper-parameters:
``lr``, ``momentum`` (optional, default 0) and ``bs`` (batch size, optional, default 32). Fixed values:
``hidden`` (64), ``minibatches`` per ``train()`` call (1), ``dropout`` (0.0, exercises the torch RNG),
``log_every`` (0: never; else a text line ``step <n> train_loss <loss>`` every that many steps, through
``log_text``). ``evaluate`` reports accuracy and loss on a fixed held-out split of 360 images.

``digits_batch`` builds a ``BatchSpec`` for it; tests, the benchmark and the demo use both.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stagetree.core.batch import BatchSpec, Point, Source, StageSpec
from stagetree.core.config import Config, FixedPart
from stagetree.core.sequences import Value
from stagetree.nodemanager.runtime.dataloader import ResumableLoader
from stagetree.nodemanager.runtime.trainer import StepMetrics, Trainer

log = logging.getLogger(__name__)

ENTRY_POINT = "stagetree.nodemanager.examples.digits:DigitsMLP"
TEST_ROWS = 360


def _digits_file() -> Path | None:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


CACHE_ENV = "STAGETREE_CACHE_DIR"


def _cache_dir() -> Path:
    """Where parsed datasets are kept: ``$STAGETREE_CACHE_DIR``, else ``$XDG_CACHE_HOME/stagetree``,
    else ``~/.cache/stagetree``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stagetree"


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's ``load_digits(return_X_y=True)``. Reads the file it ships directly when it can:
    importing ``sklearn.datasets`` costs about a second, a lot for a worker process that runs a batch.
    Parsing that CSV costs some 20 ms more, paid by every batch's worker, so the parsed array is kept
    as ``.npy`` in the cache directory (named by the source file's size and time, written atomically;
    when the directory is not writable every load parses again)."""
    path = _digits_file()
    if path is None:
        from sklearn.datasets import load_digits  # type: ignore[import-untyped]

        x, y = load_digits(return_X_y=True)
        return x, y
    st = path.stat()
    cached = _cache_dir() / f"digits-{st.st_size}-{st.st_mtime_ns}.npy"
    try:
        data = np.load(cached)
    except (OSError, ValueError):
        data = np.loadtxt(path, delimiter=",")
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                np.save(f, data)
            os.replace(tmp, cached)
        except OSError as e:
            log.debug("digits cache not written: %s", e)
    return data[:, :-1], data[:, -1].astype(np.int64)


@functools.cache
def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: features scaled to [0, 1], a split fixed by seed 0."""
    x, y = load_digits_arrays()
    perm = np.random.RandomState(0).permutation(len(x))
    xs = torch.from_numpy((x[perm] / 16.0).astype(np.float32))
    ys = torch.from_numpy(y[perm].astype(np.int64))
    return xs[TEST_ROWS:], ys[TEST_ROWS:], xs[:TEST_ROWS], ys[:TEST_ROWS]


def build_mlp(hidden: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10))


class DigitsMLP(Trainer):
    prepare_ahead = True  # init only loads the data and builds the model

    def init(self) -> None:
        x_train, y_train, self.x_test, self.y_test = (t.to(self.device) for t in digits_split())
        self.minibatches = int(self.fixed.get("minibatches", 1))
        self.model = build_mlp(int(self.fixed.get("hidden", 64)), float(self.fixed.get("dropout", 0.0)))
        self.model.to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.0)
        self.loader = ResumableLoader(x_train, y_train, batch_size=32, seed=self.seed)
        self.log_every = int(self.fixed.get("log_every", 0))

    def setup(self, hp_changes: dict[str, Value]) -> None:
        for group in self.optimizer.param_groups:
            if "lr" in hp_changes:
                group["lr"] = float(hp_changes["lr"])
            if "momentum" in hp_changes:
                group["momentum"] = float(hp_changes["momentum"])
        if "bs" in hp_changes:
            self.loader.set_batch_size(int(hp_changes["bs"]))

    def train(self) -> StepMetrics | None:
        self.model.train()
        loss = torch.zeros(())
        for _ in range(self.minibatches):
            x, y = next(self.loader)
            self.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
        if self.log_every and (self.step + 1) % self.log_every == 0:
            self.log_text(f"step {self.step + 1} train_loss {loss.item():.4f}")
        # the step's last minibatch loss, a learning-curve point; a tensor, so that converting it (a
        # device sync on a GPU) happens only for the points the runtime keeps
        return {"train_loss": loss.detach()}

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        with torch.no_grad():
            logits = self.model(self.x_test)
            loss = F.cross_entropy(logits, self.y_test).item()
            accuracy = (logits.argmax(dim=1) == self.y_test).float().mean().item()
        return {"accuracy": accuracy, "loss": loss}

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loader": self.loader.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])


def digits_batch(
    stages: Iterable[tuple[int, int, int, Mapping[str, Any]]],
    *,
    batch_id: int = 1,
    attempt: int = 1,
    seed: int = 0,
    fixed_values: Mapping[str, Any] | None = None,
    trainer: str = ENTRY_POINT,
    dataset: str = "sklearn-digits",
    source: Source | None = None,
    saves: Iterable[tuple[int, int]] = (),
    evals: Iterable[tuple[int, int]] = (),
    peripheral_every_steps: int = 0,
    peripheral_every_s: float = 0.0,
) -> BatchSpec:
    """A batch over ``stages`` given as ``(node, start, end, {hp: sequence})``; it starts from a fresh
    model at the first stage's start unless ``source`` says otherwise. Another trainer (``trainer``,
    ``dataset``) may be named: the spec is the same for any."""
    stage_specs = tuple(StageSpec(node, start, end, Config.of(hps)) for node, start, end, hps in stages)
    fixed = FixedPart(trainer=trainer, dataset=dataset, seed=seed, values=dict(fixed_values or {}))
    first = stage_specs[0]
    return BatchSpec(
        batch_id=batch_id,
        attempt=attempt,
        plan_key=fixed.key(),
        fixed=fixed,
        source=source or Source(Point(first.node, first.start)),
        stages=stage_specs,
        saves=frozenset(Point(*p) for p in saves),
        evals=frozenset(Point(*p) for p in evals),
        peripheral_every_steps=peripheral_every_steps,
        peripheral_every_s=peripheral_every_s,
    )
