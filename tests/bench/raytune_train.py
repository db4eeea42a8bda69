"""One trial trained straight through, the way a trial-by-trial system (Ray Tune) runs it.

``train_straight`` builds the same trainer stagetree's workers build (``raytune_workloads.TRAINER``, the
digits MLP in a user's module; same fixed part and
seed), seeds the RNGs the way the worker runtime does, applies the trial's hyper-parameter sequences
before each step (only the values that change, as ``BatchRun`` does) and evaluates at the requested
steps with the RNG state restored afterwards. It is both the independent reference of the exactness
check and the body of the Ray Tune trainable (``ray_trainable``), so the two systems run the same
training code.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from stagetree.core.config import Config
from stagetree.core.sequences import Value
from stagetree.nodemanager.runtime.trainer import (
    TrainerContext,
    capture_rng_state,
    load_trainer_class,
    restore_rng_state,
    seed_everything,
)
from tests.bench.raytune_workloads import TRAINER

Report = Callable[[int, dict[str, float]], None]
USERSTYLE = str(Path(__file__).resolve().parent / "userstyle")  # where TRAINER's module lives
if USERSTYLE not in sys.path:
    sys.path.append(USERSTYLE)


def train_straight(
    config_json: Mapping[str, Any],
    evals: Iterable[int],
    *,
    fixed: Mapping[str, Any],
    seed: int,
    report: Report | None = None,
    device: str = "cpu",
) -> dict[int, dict[str, float]]:
    """Train from scratch to the last of ``evals`` on ``device`` (``cuda`` as a GPU worker trains); the
    metrics at each of them."""
    config = Config.from_json(config_json)
    at = sorted(set(int(s) for s in evals))
    trainer = load_trainer_class(TRAINER)()
    trainer.bind(TrainerContext(fixed=dict(fixed), seed=seed, device=torch.device(device)))
    seed_everything(seed)
    trainer.init()
    applied: dict[str, Value] = {}
    out: dict[int, dict[str, float]] = {}
    todo = set(at)
    for s in range(at[-1]):
        values = config.values_at(s)
        changes = {
            k: v for k, v in values.items() if k not in applied or applied[k] != v or type(applied[k]) is not type(v)
        }
        if changes:
            trainer.setup(dict(changes))
            applied.update(changes)
        trainer.step = s
        trainer.train()
        if s + 1 in todo:
            rng = capture_rng_state()
            metrics = {str(k): float(v) for k, v in trainer.evaluate().items()}
            restore_rng_state(rng)
            out[s + 1] = metrics
            if report is not None:
                report(s + 1, metrics)
    return out


def ray_trainable(param: dict[str, Any]) -> None:
    """The Ray Tune function trainable: ``param["work"]`` is ``{"trial", "config", "evals", "fixed",
    "seed"}`` and optionally ``"device"`` (``cuda``: the GPU share Ray gave the trial). Reports the metrics
    at each eval step with the actor's pid, its CPU time (``time.process_time``) and the wall clock when
    the trial started and now, so the driver can add up the actors' CPU and the trials' GPU time."""
    from ray import tune

    torch.set_num_threads(1)
    cpu_start = time.process_time()
    wall_start = time.time()
    work = param["work"]
    pid = os.getpid()

    def report(step: int, metrics: dict[str, float]) -> None:
        tune.report(
            {
                **metrics,
                "step": step,
                "trial": int(work["trial"]),
                "pid": pid,
                "cpu_start": cpu_start,
                "cpu_now": time.process_time(),
                "wall_start": wall_start,
                "wall_now": time.time(),
            }
        )

    train_straight(
        work["config"],
        work["evals"],
        fixed=work["fixed"],
        seed=int(work["seed"]),
        report=report,
        device=str(work.get("device", "cpu")),
    )
