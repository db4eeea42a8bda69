"""Embedded-mode figures for ``python -m tests.bench.pipeline``: the demo's study, and what an ideal
platform would have needed for it.

The study is the demo's (``examples/digits_sha.py``: 27 learning-rate x batch-size schedules, successive
halving at steps 10, 30 and 90, 2 CPU workers) with a wider MLP (``HEAVY``) so that a step costs tens of
milliseconds instead of one: with the demo's tiny model the figure would measure process start-up, not
the platform's overhead on a real workload.

* ``embedded_steps_vs_unique`` = steps the workers trained (``store.batches.executed_steps``) / unique steps of
  the plan (each shared prefix once): 1.00 when every shared step ran exactly once.
* ``embedded_overhead`` = the study's wall time in embedded mode (from creating the study to the
  tuner's finish; the cluster's start-up is reported apart) / the *pure* time: the makespan of the same
  work on the same number of workers with no platform at all. The pure time comes from the core's
  discrete-event simulator replaying the run's exact tuner decisions (``ReplayDriver``: each group of
  submits once every result the tuner had seen before it is in) with every step costing what a plain
  PyTorch loop of the same model measured (per batch size; in as many processes at once as there are
  workers), evaluations likewise, and checkpoints free. The simulated scheduler knows each step's true
  cost, which the master only learns as batches finish (``master.costs``: every step costs the same
  until the first batch of the plan ran): the figure charges the platform for that too. The ratio
  against a simulated scheduler that never learns (every step the same cost) is printed beside it;
  with equal costs per step, ties are broken by the order of plan nodes, which the simulator numbers
  differently, so that ratio moves both ways (below 1 when the simulator's tie-break happened to be
  the worse one). The plain loop is measured before the cluster starts and after each study run (the
  cluster idle); a run's costs are the mean of the measurements either side of it, and the figure is
  the median over the runs of each run's ratio: this two-core VM's speed drifts by 20-40% over
  minutes, and a wall time divided by costs measured minutes apart measured that drift.

Run by ``tests.bench.pipeline`` in a child process of its own (``python -m tests.bench.embedded``): the
ingest cases before it leave threads and processes that would otherwise share its two cores.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import stagetree
from stagetree.client.driver import drive
from stagetree.client.tuners import SHA
from stagetree.client.tuners.base import Action, Result, Start, Submit
from stagetree.core.config import Config
from stagetree.core.scheduler import steps_cost
from stagetree.core.sharing import unique_steps
from stagetree.core.simulator import Ask, Simulator
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.master.settings import SchedulingSettings
from stagetree.nodemanager.examples.digits import build_mlp, digits_split
from tests.bench.record import record

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import digits_sha  # the demo is a script, not a package

HEAVY = {"hidden": 4096, "minibatches": 16}
WORKERS = 2
SEED = 0
RUNS = 5  # the figure is the median of per-run ratios; one run in five or so is 10-20% off (VM drift)
BATCH_SIZES = (32, 64, 128)  # the demo's batch-size sequences take these values


@dataclass(frozen=True)
class EmbeddedFigures:
    executed: int  # the most any run trained
    unique: int
    walls_s: list[float]  # each study run, creation to finish
    oracle_pures_s: list[float]  # each run's simulated makespan at the plain-loop costs measured after it
    pures_s: list[float]  # the same, scheduled with equal step costs (the master before it learns)
    startup_s: float  # the embedded cluster coming up
    step_ms: dict[int, float]  # plain-loop cost of a step per batch size (median over the runs)
    eval_ms: float

    @property
    def steps_vs_unique(self) -> float:
        return self.executed / self.unique

    @property
    def overhead(self) -> float:
        """The median over the runs of wall / pure, pure scheduled knowing each step's true cost."""
        return statistics.median(w / p for w, p in zip(self.walls_s, self.oracle_pures_s, strict=True))

    @property
    def overhead_same_cost_model(self) -> float:
        """The same with equal step costs in the simulated scheduler (the master before it learns)."""
        return statistics.median(w / p for w, p in zip(self.walls_s, self.pures_s, strict=True))


def plan_unique_steps(plan: dict[str, Any]) -> int:
    """Unique steps of a plan as the REST/SDK plan view gives it: per node, up to the furthest step
    anything on or below it has metrics at (``core.sharing.unique_steps``)."""
    nodes = {n["id"]: (n["parent"], n["start"]) for n in plan["nodes"]}
    return unique_steps(nodes, [(n["id"], st) for n in plan["nodes"] for st in n["metric_steps"]])


def plain_costs(batch_sizes: Sequence[int], steps: int = 40) -> tuple[dict[int, float], float]:
    """Seconds per step (per batch size) and per evaluation of the heavy MLP in a plain loop, one
    thread like a worker, after a warm-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x_train, y_train, x_test, y_test = digits_split()
        torch.manual_seed(SEED)
        model = build_mlp(HEAVY["hidden"], 0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        n = x_train.shape[0]
        costs: dict[int, float] = {}
        for bs in batch_sizes:
            for timed in (False, True):
                t0 = time.perf_counter()
                for _ in range(steps if timed else 5):
                    model.train()
                    for _ in range(HEAVY["minibatches"]):
                        idx = torch.randint(0, n, (bs,))
                        opt.zero_grad(set_to_none=True)
                        F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
                        opt.step()
                if timed:
                    costs[bs] = (time.perf_counter() - t0) / steps
        t0 = time.perf_counter()
        for _ in range(10):
            model.eval()
            with torch.no_grad():
                logits = model(x_test)
                (logits.argmax(dim=1) == y_test).float().mean().item()
                F.cross_entropy(logits, y_test).item()
        return costs, (time.perf_counter() - t0) / 10
    finally:
        torch.set_num_threads(threads)


class ReplayDriver:
    """Plays a real run's tuner decisions in the simulator. Each group of submits the tuner made in the
    real run is released once the simulator has delivered every result the tuner had seen by then (in
    any order): a synchronous tuner's rung waits for all of the rung before it, in the simulator too.
    Releasing a group on the one result that preceded it in the real run would let the ideal platform
    start a rung while the one before it still trains, whenever the results come in another order."""

    def __init__(self, trace: Sequence[tuple[object, list[Action]]]) -> None:
        self.first: list[Submit] = []
        self.seen_order: list[tuple[int, int]] = []  # the results in the order the real tuner saw them
        self.groups: list[tuple[int, list[Submit]]] = []  # (results seen before it, submits), in order
        for event, actions in trace:
            if isinstance(event, Result):
                self.seen_order.append((event.trial_id, event.step))
            subs = [a for a in actions if isinstance(a, Submit)]
            if not subs:
                continue
            if isinstance(event, Start):
                self.first.extend(subs)
            else:
                self.groups.append((len(self.seen_order), subs))
        self.delivered: set[tuple[int, int]] = set()
        self.prefix = 0  # seen_order[:prefix] have all been delivered
        self.released = 0  # groups[:released] have been submitted

    @staticmethod
    def _asks(subs: Sequence[Submit]) -> list[Ask]:
        return [Ask((s.trial_id, s.step), Config.of(s.config), s.step) for s in subs]

    def start(self) -> list[Ask]:
        return self._asks(self.first)

    def on_result(self, tag: Any, step: int, metrics: dict[str, float]) -> list[Ask]:
        self.delivered.add(tag)
        while self.prefix < len(self.seen_order) and self.seen_order[self.prefix] in self.delivered:
            self.prefix += 1
        out: list[Submit] = []
        while self.released < len(self.groups) and self.groups[self.released][0] <= self.prefix:
            out.extend(self.groups[self.released][1])
            self.released += 1
        return self._asks(out)


PlainCosts = tuple[dict[int, float], float]  # seconds per step by batch size, seconds per evaluation


@dataclass(frozen=True)
class StudyRun:
    trace: Sequence[tuple[object, list[Action]]]
    plan: dict[str, Any]
    executed: int
    wall_s: float
    costs: PlainCosts  # the plain loop, the mean of its measurements just before and just after this run


async def _run_studies(home: Path, runs: int) -> tuple[list[StudyRun], float]:
    """The study ``runs`` times on one embedded cluster (each on a plan of its own: the fixed value
    ``bench_run`` differs, so no run is answered from an earlier one's results), with the plain-loop
    costs measured before the cluster starts and after each run; and the start-up. A run's costs are the
    mean of the measurements either side of it, so that a drift of the VM's speed during the run is
    split instead of charged to the platform or to the baseline."""
    before = await asyncio.to_thread(parallel_plain_costs)
    t0 = time.monotonic()
    out = []
    async with Embedded(EmbeddedSettings(home=home, workers=WORKERS)) as cluster:
        await cluster.workers_ready()  # the studies are timed without the start-up
        startup = time.monotonic() - t0
        async with stagetree.connect(cluster.target, token=cluster.token) as client:
            for i in range(runs):
                t1 = time.monotonic()
                study = await stagetree.Study.create(
                    client,
                    f"digits-sha-heavy-{i}",
                    trainer=digits_sha.TRAINER,
                    dataset="sklearn-digits",
                    model=f"mlp-{HEAVY['hidden']}",
                    seed=SEED,
                    values={**HEAVY, "bench_run": i},
                    tuned=["lr", "bs", "momentum"],
                )
                tuner = SHA(digits_sha.search_space(), metric="accuracy", mode="max", eta=3, min_step=10, max_step=90)
                run = await drive(study, tuner)
                wall = time.monotonic() - t1
                plan = await study.plan()
                store = cluster.app.store
                plan_id = (await asyncio.to_thread(store.requests.get_requests, study.id))[0].plan_id
                executed = await asyncio.to_thread(store.batches.executed_steps, plan_id)
                after = await asyncio.to_thread(parallel_plain_costs)
                out.append(StudyRun(run.trace, plan, executed, wall, mean_costs(before, after)))
                print(
                    f"  run {i + 1}: study wall {wall:.2f} s, executed {executed} steps; plain-loop step ms before "
                    f"{ {bs: round(c * 1000, 1) for bs, c in before[0].items()} }, after "
                    f"{ {bs: round(c * 1000, 1) for bs, c in after[0].items()} }",
                    flush=True,
                )
                before = after
    return out, startup


def mean_costs(a: PlainCosts, b: PlainCosts) -> PlainCosts:
    """The mean of two plain-loop measurements, per batch size and for the evaluation."""
    return {bs: (a[0][bs] + b[0][bs]) / 2 for bs in a[0]}, (a[1] + b[1]) / 2


def _plain_costs_child(barrier: Any, out: Any) -> None:
    barrier.wait()
    out.put(plain_costs(BATCH_SIZES))


def parallel_plain_costs(workers: int = WORKERS) -> PlainCosts:
    """``plain_costs`` measured in ``workers`` processes at once, as the embedded workers run: two
    trainings side by side on two cores are each slower than one alone (shared caches and memory
    bandwidth), and that is the machine's cost, not the platform's. The mean over the processes."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_plain_costs_child, args=(barrier, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    steps = {bs: sum(g[0][bs] for g in got) / len(got) for bs in BATCH_SIZES}
    return steps, sum(g[1] for g in got) / len(got)


def pure_makespan(run: StudyRun, *, oracle: bool = False) -> float:
    """The run's ideal makespan: its tuner decisions replayed in the simulator at its plain-loop costs.
    ``oracle``: its scheduler knows each step's true cost (a bs=128 step costs four bs=32 ones); else it
    decides as the master does before it learns: every step the same cost (``steps_cost``)."""
    step_s, eval_s = run.costs

    def step_time(config: Config, step: int) -> float:
        return step_s[int(config.values_at(step)["bs"])]

    decision_cost = None if oracle else steps_cost(SchedulingSettings().default_step_seconds)
    sim = Simulator(ReplayDriver(run.trace), WORKERS, step_time=step_time, eval_s=eval_s, decision_cost=decision_cost)
    return sim.run().makespan


def embedded_figures(home: Path | None = None, runs: int = RUNS) -> EmbeddedFigures:
    with tempfile.TemporaryDirectory(prefix="stagetree-bench-embedded-") as tmp:
        studies, startup = asyncio.run(_run_studies(home or Path(tmp), runs))
    return EmbeddedFigures(
        executed=max(s.executed for s in studies),
        unique=plan_unique_steps(studies[0].plan),
        walls_s=[s.wall_s for s in studies],
        pures_s=[pure_makespan(s) for s in studies],
        oracle_pures_s=[pure_makespan(s, oracle=True) for s in studies],
        startup_s=startup,
        step_ms={bs: statistics.median(s.costs[0][bs] for s in studies) * 1000 for bs in BATCH_SIZES},
        eval_ms=statistics.median(s.costs[1] for s in studies) * 1000,
    )


def main() -> None:
    f = embedded_figures()
    pairs = ", ".join(f"{w:.2f}/{p:.2f}" for w, p in zip(f.walls_s, f.oracle_pures_s, strict=True))
    print(
        f"  executed {f.executed} steps, unique {f.unique}; study wall / pure per run (s): {pairs} (cluster "
        f"start-up {f.startup_s:.2f} s apart; plain-loop step ms by batch size, median "
        f"{ {bs: round(ms, 1) for bs, ms in f.step_ms.items()} }, eval {f.eval_ms:.1f} ms)",
        flush=True,
    )
    print(
        f"  against a simulated scheduler that never learns costs (every step the same) instead: "
        f"{f.overhead_same_cost_model:.2f}",
        flush=True,
    )
    print(record("embedded", f"embedded_steps_vs_unique={f.steps_vs_unique:.2f} embedded_overhead={f.overhead:.2f}"))


if __name__ == "__main__":
    main()
