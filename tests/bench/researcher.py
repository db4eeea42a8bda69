"""The researcher's loop, measured in embedded mode: ``python -m tests.bench.researcher``.

A trainer file is written to a temp dir (a small MLP on scikit-learn's breast_cancer, tuned ``lr``,
``bs`` and ``momentum`` schedules) and imported from there, by the client (for its code digest) and by
the workers (``PYTHONPATH``), as a user's own module would be.

* (a) evaluate a config, **edit the trainer's source** (a wider hidden layer: the old checkpoints no
  longer fit), restart the cluster on the same database and evaluate again in a new study with the same
  fixed part, at the same step and beyond. ``stale_after_edit`` is true when the second study got the
  old code's metrics or resumed its checkpoints (it executed fewer steps than a fresh run, or failed).
* (b) a trainer that raises in ``train()``: ``traceback_shown`` is true when the ``EvalFailed`` message
  holds the traceback (the raising function and its message); ``user_error_attempts`` is how many
  attempts the master gave the failing request.
* (c) the 48-trial grid of warmup × lr families × batch-size × momentum schedules to step 60:
  ``executed_vs_unique_by_value`` = steps executed (``study.stats()``) / unique steps by value (distinct
  prefixes of per-step hyper-parameter values over all trials: two trials whose values agree on
  [0, s) train step s - 1 identically). ``stats_public`` is true when the public ``study.stats()``
  agrees with the ledger's own count of executed steps and with the plan's unique steps.

Last line:
``stale_after_edit=<b> traceback_shown=<b> user_error_attempts=<n> executed_vs_unique_by_value=<r> stats_public=<b>``
(targets: false, true, 1, 1.000, true).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import select

import stagetree
from stagetree.client.sdk import EvalFailed
from stagetree.core.config import Config
from stagetree.core.sequences import Constant, Cosine, Exponential, MultiStep, Warmup
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.master.store import models as m
from tests.bench.record import record

MODULE = "bench_cancer_trainer"
BAD_MODULE = "bench_failing_trainer"
GRID_STEP = 60

TRAINER = '''
"""A small MLP on scikit-learn's breast_cancer, written by tests.bench.researcher."""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer

from stagetree.nodemanager.runtime.dataloader import ResumableLoader
from stagetree.nodemanager.runtime.trainer import Trainer

HIDDEN = {hidden}


class CancerMLP(Trainer):
    def init(self):
        x, y = load_breast_cancer(return_X_y=True)
        x = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)
        y = torch.tensor(y, dtype=torch.int64)
        g = torch.Generator().manual_seed(0)
        perm = torch.randperm(len(x), generator=g)
        x, y = x[perm], y[perm]
        self.x_test, self.y_test = x[:100], y[:100]
        self.model = torch.nn.Sequential(torch.nn.Linear(30, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 2))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.0)
        self.loader = ResumableLoader(x[100:], y[100:], batch_size=32, seed=self.seed)

    def setup(self, hp_changes):
        for group in self.optimizer.param_groups:
            if "lr" in hp_changes:
                group["lr"] = float(hp_changes["lr"])
            if "momentum" in hp_changes:
                group["momentum"] = float(hp_changes["momentum"])
        if "bs" in hp_changes:
            self.loader.set_batch_size(int(hp_changes["bs"]))

    def train(self):
        x, y = next(self.loader)
        self.optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(self.model(x), y).backward()
        self.optimizer.step()

    def evaluate(self):
        with torch.no_grad():
            logits = self.model(self.x_test)
        return {{"accuracy": (logits.argmax(1) == self.y_test).float().mean().item()}}

    def state_dict(self):
        return {{"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "loader": self.loader.state_dict()}}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
'''

FAILING = '''
"""A trainer whose train() raises at step 3, written by tests.bench.researcher."""

from bench_cancer_trainer import CancerMLP


def check_the_batch(step):
    if step >= 3:
        raise RuntimeError(f"exploded on purpose at step {step}")


class Failing(CancerMLP):
    def train(self):
        check_the_batch(self.step)
        super().train()
'''


def grid() -> list[dict[str, Any]]:
    """48 trials: (no warmup | a 5-step warmup) × 4 lr families from 0.1 × 2 batch-size × 3 momentum
    schedules. Families from the same value agree at their first step (and the momentum ones at 0.9)."""

    def families() -> Iterator[Any]:
        yield Constant(0.1)
        yield Cosine(0.1, 0.001, GRID_STEP)
        yield Exponential(0.1, 0.97)
        yield MultiStep(0.1, [30], 0.3)

    out = []
    for warm, lr, bs, mom in itertools.product(
        (False, True),
        range(4),
        (Constant(32), MultiStep(32, [30], 2)),
        (Constant(0.9), Cosine(0.9, 0.5, GRID_STEP), Exponential(0.9, 0.99)),
    ):
        fam = list(families())[lr]
        out.append({"lr": Warmup(0.02, 5, fam) if warm else fam, "bs": bs, "momentum": mom})
    return out


def unique_steps_by_value(configs: Sequence[dict[str, Any]], step: int) -> int:
    """Distinct prefixes of per-step values: step s - 1 is trained once per distinct values on [0, s)."""
    seen: set[tuple[Any, ...]] = set()
    for cfg in configs:
        c = Config.of(cfg)
        prefix: tuple[Any, ...] = ()
        for s in range(step):
            values = tuple((k, type(v).__name__, v) for k, v in sorted(c.values_at(s).items()))
            prefix = (*prefix, values)
            seen.add(prefix)
    return len(seen)


def write_trainer(root: Path, hidden: int) -> None:
    (root / f"{MODULE}.py").write_text(textwrap.dedent(TRAINER.format(hidden=hidden)))


async def _cluster_study(home: Path, name: str, trainer: str, body: Any) -> Any:
    async with (
        Embedded(EmbeddedSettings(home=home, workers=2)) as cluster,
        stagetree.connect(cluster.target, token=cluster.token) as client,
    ):
        study = await stagetree.Study.create(
            client, name, trainer=trainer, dataset="breast_cancer", tuned=["lr", "bs", "momentum"]
        )
        return await body(cluster, study)


async def stale_after_edit(root: Path) -> tuple[bool, str]:
    home = root / "home-a"
    cfg = {"lr": Constant(0.05), "bs": Constant(32), "momentum": Constant(0.9)}
    write_trainer(root, hidden=16)

    async def first(_cluster: Embedded, study: stagetree.Study) -> dict[str, float]:
        return await study.eval(cfg, 20)

    await _cluster_study(home, "before-edit", f"{MODULE}:CancerMLP", first)
    write_trainer(root, hidden=48)  # the user changes the model

    async def second(_cluster: Embedded, study: stagetree.Study) -> tuple[bool, str]:
        try:
            await study.eval(cfg, 20)
            await study.eval(cfg, 30)  # extending it would resume the old code's checkpoint
        except EvalFailed as e:
            return True, f"extending failed: {e.message[:200]}"
        stats = await study.stats()
        return stats.steps_executed < 30, f"executed {stats.steps_executed} steps after the edit (a fresh run: 30)"

    return await _cluster_study(home, "after-edit", f"{MODULE}:CancerMLP", second)


async def user_error(root: Path) -> tuple[bool, int, str]:
    (root / f"{BAD_MODULE}.py").write_text(textwrap.dedent(FAILING))
    cfg = {"lr": Constant(0.05), "bs": Constant(32), "momentum": Constant(0.9)}

    async def body(cluster: Embedded, study: stagetree.Study) -> tuple[bool, int, str]:
        try:
            await study.eval(cfg, 10)
        except EvalFailed as e:
            message = e.message
        else:
            return False, 0, "the failing trainer succeeded"
        with cluster.app.store.db.tx("bench: attempts") as s:  # the bench's own measurement
            failures = s.scalar(select(m.Request.failures).where(m.Request.study_id == study.id))
        shown = "check_the_batch" in message and "exploded on purpose at step 3" in message
        return shown, int(failures or 0), message

    return await _cluster_study(root / "home-b", "failing", f"{BAD_MODULE}:Failing", body)


async def grid_sharing(root: Path) -> tuple[float, bool, str]:
    configs = grid()

    async def body(cluster: Embedded, study: stagetree.Study) -> tuple[float, bool, str]:
        t0 = time.monotonic()
        await asyncio.gather(*(study.eval(c, GRID_STEP, label=f"trial-{i}") for i, c in enumerate(configs)))
        wall = time.monotonic() - t0
        plan_id = (await asyncio.to_thread(cluster.app.store.requests.get_requests, study.id))[0].plan_id
        # The last answers come with their metrics, before their batch's end is applied: study.stats()
        # counts a running attempt's steps, the ledger only ended attempts'. Compared once both are read
        # after the batches ended (or after 30 s, when they disagree for good).
        deadline = time.monotonic() + 30.0
        while True:
            stats = await study.stats()
            ledger = await asyncio.to_thread(cluster.app.store.batches.executed_steps, plan_id)
            if stats.steps_executed == ledger or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        by_value = unique_steps_by_value(configs, GRID_STEP)
        public = stats.steps_executed == ledger and stats.trial_by_trial_steps == len(configs) * GRID_STEP
        note = (
            f"{len(configs)} trials to step {GRID_STEP} in {wall:.1f} s: executed {stats.steps_executed} "
            f"(ledger {ledger}), unique in the plan {stats.unique_steps}, unique by value {by_value}, "
            f"trial by trial {stats.trial_by_trial_steps}, merge rate {stats.merge_rate:.2f}"
        )
        return stats.steps_executed / by_value, public, note

    return await _cluster_study(root / "home-c", "grid", f"{MODULE}:CancerMLP", body)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="stagetree-researcher-") as tmp:
        root = Path(tmp)
        sys.path.insert(0, str(root))  # the client digests the trainer's source from here
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
        stale, why = asyncio.run(stale_after_edit(root))
        print(f"(a) edit the trainer: stale={stale}: {why}", flush=True)
        shown, attempts, message = asyncio.run(user_error(root))
        print(f"(b) failing trainer: {attempts} attempt(s); the error reads:\n{textwrap.indent(message, '    ')}")
        write_trainer(root, hidden=16)
        ratio, public, note = asyncio.run(grid_sharing(root))
        print(f"(c) grid: {note}", flush=True)
    print(
        record(
            "researcher",
            f"stale_after_edit={str(stale).lower()} traceback_shown={str(shown).lower()} "
            f"user_error_attempts={attempts} executed_vs_unique_by_value={ratio:.3f} "
            f"stats_public={str(public).lower()}",
        )
    )


if __name__ == "__main__":
    main()
