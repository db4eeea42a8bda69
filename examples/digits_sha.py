"""The demo (`make demo`): tune an MLP on scikit-learn's digits by successive halving, in embedded mode.

27 trials, each a learning-rate schedule (a shared 5-step warmup, then cosine / multistep / exponential
variants) with a batch-size sequence (32 throughout, or doubled or quadrupled at step 40), halved
at steps 10 and 30 down to 3 trials trained to step 90. Trials whose schedules agree on a prefix share
that prefix's training through the stage tree; the summary says how much that saved.

    python examples/digits_sha.py [--workers 2] [--home .stagetree-demo]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import stagetree
from stagetree.client.driver import drive
from stagetree.client.spaces import GridSearchSpace
from stagetree.client.tuners import SHA
from stagetree.client.tuners.base import Result, Start
from stagetree.core.sequences import Constant, Cosine, Exponential, MultiStep, Sequence, Warmup
from stagetree.embedded import Embedded, EmbeddedSettings

TRAINER = "stagetree.nodemanager.examples.digits:DigitsMLP"
MAX_STEP = 90


def search_space() -> GridSearchSpace:
    def warm(then: Sequence) -> Warmup:
        return Warmup(0.02, 5, then)

    lr = [
        warm(Cosine(0.2, 0.005, 85)),
        warm(Cosine(0.1, 0.002, 85)),
        warm(Cosine(0.05, 0.001, 85)),
        warm(MultiStep(0.2, [30, 60], 0.3)),
        warm(MultiStep(0.1, [45, 75], 0.3)),
        warm(MultiStep(0.05, [60], 0.5)),
        warm(Exponential(0.2, 0.98)),
        warm(Exponential(0.1, 0.99)),
        warm(Exponential(0.05, 0.995)),
    ]
    bs = [Constant(32), MultiStep(32, [40], 2), MultiStep(32, [40], 4)]
    return GridSearchSpace({"lr": lr, "bs": bs, "momentum": [0.9]})


class Progress:
    """One status line, rewritten in place: rung, trials running and finished, best so far."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.started = 0
        self.results = 0
        self.best: float | None = None
        self.t0 = time.monotonic()
        self.tty = sys.stdout.isatty()

    def __call__(self, event: Any, _actions: list[Any]) -> None:
        if isinstance(event, Start):
            return
        if isinstance(event, Result):
            self.results += 1
            acc = event.metrics.get("accuracy")
            if acc is not None and (self.best is None or acc > self.best):
                self.best = acc
        best = "-" if self.best is None else f"{self.best:.4f}"
        line = f"  evals done {self.results:3d}   best accuracy {best}   {time.monotonic() - self.t0:6.1f} s"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)


async def run(workers: int, home: Path) -> int:
    space = search_space()
    n = space.size() or 0
    print(f"stagetree demo: {n} trials on digits (MLP), successive halving at steps 10, 30, {MAX_STEP}")
    t0 = time.monotonic()
    async with Embedded(EmbeddedSettings(home=home, workers=workers)) as cluster:
        print(f"  embedded cluster up at {cluster.target} with {workers} CPU workers ({time.monotonic() - t0:.1f} s)")
        async with stagetree.connect(cluster.target, token=cluster.token) as client:
            study = await stagetree.Study.create(
                client,
                "digits-sha",
                trainer=TRAINER,
                dataset="sklearn-digits",
                model="mlp-64",
                seed=0,
                values={"hidden": 64, "minibatches": 4},
                tuned=["lr", "bs", "momentum"],
            )
            tuner = SHA(space, metric="accuracy", mode="max", eta=3, min_step=10, max_step=MAX_STEP)
            progress = Progress(n)
            result = await drive(study, tuner, on_event=progress)
            print()
            best = await study.best("accuracy", "max")
            stats = await study.stats()  # the public API: what sharing bought this study
    wall = time.monotonic() - t0
    print()
    if best is None:
        print("no trial finished; see the worker logs under", home / "work")
        return 1
    print(f"best accuracy      {best.metrics['accuracy']:.4f} at step {best.step}")
    print("best configuration")
    for name, seq in sorted((best.config or {}).items()):
        print(f"  {name:9s} {seq!r}")
    print(f"trials             {n}")
    print(f"evaluations        {len(result.submits())}")
    print(f"merge rate         {stats.merge_rate:.2f}  (trial-by-trial steps / unique steps)")
    print(
        f"steps executed     {stats.steps_executed}  vs  {stats.trial_by_trial_steps} a trial-by-trial system "
        f"would run ({stats.unique_steps} unique)"
    )
    print(f"compute            {stats.compute_seconds:.1f} s used, about {stats.saved_seconds:.1f} s saved by sharing")
    print(f"wall time          {wall:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--home", type=Path, default=Path(".stagetree-demo"))
    p.add_argument("--keep", action="store_true", help="keep the previous run's database (its results are reused)")
    ns = p.parse_args(argv)
    if ns.home.exists() and not ns.keep:
        shutil.rmtree(ns.home)
    return asyncio.run(run(ns.workers, ns.home))


if __name__ == "__main__":
    sys.exit(main())
