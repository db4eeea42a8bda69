"""Plain Optuna side by side with stagetree driving the same Optuna sampler, on real PyTorch CPU training.

    pip install ".[bench]"        # optuna, cmaes
    python -m tests.bench.vs_optuna [--trials 64] [--minibatches 20] [--hidden 128] [--seed 0]

The workload: the digits MLP (``stagetree.nodemanager.examples.torch_digits.DigitsTorch``, a
``TorchTrainer``) over one ``OptunaSpace``: a 5-step warmup into a decay family chosen by the sampler
(cosine, exponential, multistep, each with its peak learning rate on a 4-point grid and its own
categorical parameters) times three batch-size sequences; momentum 0.9. Rungs at steps 10, 30, 90
(reduction factor 3). Both sides draw 64 trials with ``TPESampler(seed)``:

1. plain Optuna: TPE with its ``SuccessiveHalvingPruner`` (min resource 10, reduction factor 3); each trial
   trains from scratch in the objective, reporting accuracy at each rung, two trials at a time (two
   worker processes on one Optuna SQLite storage, each with its own sampler seed);
2. stagetree: the same sampler through ``OptunaTuner`` with ASHA promotions (the rungs above), in
   embedded mode with two CPU slots; trials that share a prefix train it once, and a proposal that
   repeats an earlier configuration is answered from the stored metrics.

Every training process runs one torch thread. Figures:

* ``optuna_best`` / ``stagetree_best``: the best accuracy at step 90;
* ``cpu_s_ratio``: CPU-seconds of the processes that train, Optuna's over stagetree's (Optuna: its two
  worker processes' ``process_time`` over ``optimize``; stagetree: its worker processes' tree, as in
  ``vs_raytune``);
* ``e2e_ratio``: wall-clock seconds of the whole study, Optuna's over stagetree's. Neither counts its
  start-up: Optuna's from when both workers have imported everything and loaded the data; stagetree's
  from the study's creation to the tuner's finish, the embedded cluster up with its warm workers;
* ``merge_rate``: stagetree's (the study's steps trial by trial over the unique steps it trained).

With ``--runs N`` the two sides alternate which goes first and every figure is the median of N (the
best accuracies too: both samplers are seeded, so they differ between runs only through timing).

Last line: ``optuna_best=<acc> stagetree_best=<acc> cpu_s_ratio=<r> e2e_ratio=<r> merge_rate=<m>``.
Targets: stagetree_best >= optuna_best - 0.005, cpu_s_ratio >= 0.8 x merge_rate, e2e_ratio >= 1.5.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
import torch

from stagetree.client.spaces import Choice, Family, LogUniform
from stagetree.core.config import Config, FixedPart
from stagetree.core.sequences import Cosine, Exponential, MultiStep, Warmup
from stagetree.integrations.optuna import OptunaSpace, OptunaTuner
from stagetree.nodemanager.examples.digits import digits_split
from stagetree.nodemanager.examples.torch_digits import ENTRY_POINT, DigitsTorch
from stagetree.nodemanager.runtime.executor import new_trainer
from tests.bench.vs_raytune import STAGETREE_WORKERS, _children_cpu, _forkserver_pid, _live_children, _tree_cpu

log = logging.getLogger(__name__)

RUNGS = (10, 30, 90)
ETA = 3
METRIC = "accuracy"
DATASET = "sklearn-digits"
TIMEOUT_S = 1800.0


def space() -> OptunaSpace:
    peak = LogUniform(0.03, 0.3)
    decay = Choice(
        [
            Family(Cosine, init=peak, min_value=0.001, period=85),
            Family(Exponential, init=peak, gamma=Choice([0.97, 0.99])),
            Family(MultiStep, init=peak, milestones=Choice([[30, 60], [45, 75]]), gamma=0.3),
        ]
    )
    return OptunaSpace(
        {
            "lr": Family(Warmup, init=0.01, period=5, then=decay),
            "bs": Choice([32, MultiStep(32, [40], 2), MultiStep(32, [40], 4)]),
            "momentum": 0.9,
        },
        grid=4,
    )


# ---------------------------------------------------------------------------------------------
# 1. plain Optuna


def objective_factory(fixed: FixedPart) -> Any:
    def objective(trial: optuna.Trial) -> float:
        config = Config.of(space().suggest(trial))
        trainer = new_trainer(DigitsTorch, fixed, torch.device("cpu"))
        applied: dict[str, Any] = {}
        acc = 0.0
        for s in range(RUNGS[-1]):
            values = config.values_at(s)
            changes = {k: v for k, v in values.items() if applied.get(k) != v}
            if changes:
                trainer.setup(changes)
                applied.update(changes)
            trainer.step = s
            trainer.train()
            if s + 1 in RUNGS:
                acc = trainer.evaluate()[METRIC]
                trial.report(acc, s + 1)
                if trial.should_prune():
                    raise optuna.TrialPruned()
        return acc

    return objective


def _storage(path: str) -> optuna.storages.BaseStorage:
    # SQLite through Optuna's RDB storage: a waiting writer blocks on the database lock (its journal
    # file storage polls its lock with sleeps growing to 1 s, which a loaded machine turns into seconds)
    return optuna.storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={"connect_args": {"timeout": 60}})


def _optuna_worker(
    storage_path: str, seed: int, n_trials: int, fixed_json: str, cpu_file: str, ready: Any, go: Any
) -> None:
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = _storage(storage_path)
    study = optuna.load_study(
        study_name="digits", storage=storage, sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=RUNGS[0], reduction_factor=ETA),
    )  # fmt: skip
    fixed = FixedPart.from_json(json.loads(fixed_json))
    objective = objective_factory(fixed)
    # what a warm stagetree worker has done before its batch: torch's optimizers import torch._dynamo on
    # first use (seconds), which stagetree's workers preload; and the data set loaded
    importlib.import_module("torch._dynamo")
    digits_split()
    ready.put(seed)
    go.wait()
    cpu0 = time.process_time()
    study.optimize(objective, n_trials=n_trials)
    Path(cpu_file).write_text(str(time.process_time() - cpu0))


def run_optuna(work: Path, fixed: FixedPart, n_trials: int, seed: int) -> tuple[float, float, float, int]:
    """(best accuracy at the last rung, CPU-seconds of the workers, wall seconds, steps trained).

    The workers are started fresh (``spawn``: this process may hold gRPC threads, and forking it is not
    safe) and timed from when both have imported everything and loaded the data, as stagetree's warm
    workers are."""
    storage_path = str(work / "optuna.db")
    storage = _storage(storage_path)
    optuna.create_study(study_name="digits", storage=storage, direction="maximize")
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Queue(), ctx.Event()
    half = [n_trials // 2, n_trials - n_trials // 2]
    fixed_json = json.dumps(fixed.to_json())
    procs = [
        ctx.Process(
            target=_optuna_worker,
            args=(storage_path, seed + i, half[i], fixed_json, str(work / f"cpu-{i}"), ready, go),
        )
        for i in range(2)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    t0 = time.perf_counter()
    go.set()
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"an Optuna worker failed: exit codes {[p.exitcode for p in procs]}")
    cpu = sum(float((work / f"cpu-{i}").read_text()) for i in range(2))
    study = optuna.load_study(study_name="digits", storage=storage)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = max((t.value for t in complete if t.value is not None), default=float("nan"))
    steps = sum(max(t.intermediate_values, default=0) for t in study.trials)
    return best, cpu, wall, steps


# ---------------------------------------------------------------------------------------------
# 2. stagetree


async def run_stagetree(home: Path, values: dict[str, Any], n_trials: int, seed: int) -> dict[str, Any]:
    import stagetree
    from stagetree.embedded import Embedded, EmbeddedSettings

    settings = EmbeddedSettings(home=home, workers=STAGETREE_WORKERS, threads_per_worker=1)
    async with Embedded(settings) as cluster, stagetree.connect(cluster.target, token=cluster.token) as client:
        await _idle(cluster)
        fs = _forkserver_pid()
        cpu0 = (_tree_cpu([fs]) if fs is not None else 0.0) + _children_cpu()
        t0 = time.perf_counter()
        study = await stagetree.Study.create(
            client, "vs-optuna", trainer=ENTRY_POINT, dataset=DATASET, seed=seed, values=values,
            tuned=["lr", "bs", "momentum"],
        )  # fmt: skip
        tuner = OptunaTuner(
            space(), optuna.samplers.TPESampler(seed=seed), metric=METRIC, mode="max", n_trials=n_trials,
            min_step=RUNGS[0], max_step=RUNGS[-1], eta=ETA, promotions="asha", max_concurrent=4,
        )  # fmt: skip
        await asyncio.wait_for(stagetree.drive(study, tuner), TIMEOUT_S)
        wall = time.perf_counter() - t0
        await _idle(cluster)
        fs = _forkserver_pid()
        cpu = (_tree_cpu([fs]) if fs is not None else 0.0) + _children_cpu() - cpu0
        stats = await study.stats()
    best = max((t.results[RUNGS[-1]][METRIC] for t in tuner.trials.values() if RUNGS[-1] in t.results), default=0.0)
    return {
        "best": best,
        "cpu": cpu,
        "wall": wall,
        "merge_rate": stats.merge_rate,
        "executed": stats.steps_executed,
        "trial_steps": stats.trial_by_trial_steps,
        "trials": len(tuner.trials),
        "distinct": len({tuple(sorted((k, repr(v)) for k, v in t.config.items())) for t in tuner.trials.values()}),
    }


async def _idle(cluster: Any) -> None:
    """Until no batch runs and only the slots' warm workers are alive (their CPU then counts live)."""
    store = cluster.app.store
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = await asyncio.to_thread(store.rounds.busy_slots)
        fs = _forkserver_pid()
        if not busy and (fs is None or _live_children(fs) <= STAGETREE_WORKERS):
            return
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=64)
    p.add_argument("--minibatches", type=int, default=20, help="minibatches per step (the cost of a step)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=1, help="runs, the side that goes first alternating; medians")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)
    values = {"hidden": ns.hidden, "minibatches": ns.minibatches}
    fixed = FixedPart(trainer=ENTRY_POINT, dataset=DATASET, seed=ns.seed, values=values)
    print(f"vs_optuna: {ns.trials} TPE trials, rungs {RUNGS}, digits MLP hidden {ns.hidden}, "
          f"{ns.minibatches} minibatches/step, 2 workers each, {ns.runs} run(s)", flush=True)  # fmt: skip
    opt: list[tuple[float, float, float, int]] = []
    sts: list[dict[str, Any]] = []
    for i in range(ns.runs):
        work = Path(tempfile.mkdtemp(prefix="vs-optuna-"))
        try:
            for side in ("optuna", "stagetree") if i % 2 == 0 else ("stagetree", "optuna"):
                if side == "optuna":
                    opt.append(run_optuna(work, fixed, ns.trials, ns.seed))
                    o_best, o_cpu, o_wall, o_steps = opt[-1]
                    print(f"  optuna     best {o_best:.4f}  cpu_s {o_cpu:7.1f}  e2e {o_wall:7.1f} s  "
                          f"steps trained {o_steps}", flush=True)  # fmt: skip
                else:
                    st = asyncio.run(run_stagetree(work / "stagetree", values, ns.trials, ns.seed))
                    sts.append(st)
                    print(
                        f"  stagetree  best {st['best']:.4f}  cpu_s {st['cpu']:7.1f}  e2e {st['wall']:7.1f} s  steps "
                        f"trained {st['executed']} (trial by trial {st['trial_steps']}; {st['distinct']} distinct "
                        f"configs of {st['trials']} trials)",
                        flush=True,
                    )
        finally:
            shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    cpu_ratio = med(o[1] for o in opt) / max(med(s["cpu"] for s in sts), 1e-9)
    e2e_ratio = med(o[2] for o in opt) / max(med(s["wall"] for s in sts), 1e-9)
    print(
        f"optuna_best={med(o[0] for o in opt):.4f} stagetree_best={med(s['best'] for s in sts):.4f} "
        f"cpu_s_ratio={cpu_ratio:.2f} e2e_ratio={e2e_ratio:.2f} merge_rate={med(s['merge_rate'] for s in sts):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
