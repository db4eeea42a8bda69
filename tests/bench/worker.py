"""Benchmark of the worker runtime: its overhead over a plain PyTorch loop, checkpoint costs, exactness.

    python -m tests.bench.worker [--steps 2000] [--runs 5]

* overhead: the digits MLP trained for ``--steps`` steps through the runtime (``run_batch`` with the
  worker's JSON-lines event writer, a progress event per step, a learning-curve point per step (its
  ``train()`` returns the step loss; no rate limit), evaluations every 200 steps, no checkpoints asked
  for) against the same training written as a plain PyTorch loop; one process each,
  one torch thread each, interleaved, median of ``--runs``; wall-clock time from before trainer init to
  after the last evaluation (interpreter start and imports excluded, ``torch._dynamo`` included: the
  first optimizer imports it lazily). CPU time is reported beside it:
  on a shared machine it is the steadier figure. The plain loop draws the same batches, so it also
  reports whether both reach identical metrics. ``curve_overhead`` is the same runtime with the curve
  off (``curve_every_steps=0``), interleaved in the same runs: what a point per step costs.
* ckpt_save_ms / ckpt_load_ms: a central checkpoint of the trainer (snapshot + write + fsync into a
  ``LocalCheckpointStore``) and its restore into a fresh trainer, medians.
* resume_exact: 30 steps straight == 10 steps + checkpoint + restore + 20 steps, across a batch-size
  change, compared exactly.

The last line printed is ``runtime_overhead=<ratio> ckpt_save_ms=<s> ckpt_load_ms=<l> resume_exact=<b>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stagetree.core.batch import Point, Source
from stagetree.core.sequences import MultiStep
from stagetree.nodemanager.examples.digits import DigitsMLP, build_mlp, digits_batch, digits_split
from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
from stagetree.nodemanager.runtime.executor import run_batch
from stagetree.nodemanager.runtime.state import restore, take_snapshot
from stagetree.nodemanager.runtime.trainer import TrainerContext, seed_everything
from stagetree.nodemanager.runtime.worker import EventWriter
from tests.bench.record import record

SEED = 7
FIXED = {"minibatches": 4, "hidden": 64}
HP = {"lr": 0.05, "momentum": 0.9, "bs": 32}
EVAL_EVERY = 200


def _spec(steps: int, curve: bool = True) -> Any:
    evals = [(1, s) for s in range(EVAL_EVERY, steps + 1, EVAL_EVERY)]
    spec = digits_batch([(1, 0, steps, HP)], seed=SEED, fixed_values=FIXED, evals=evals)
    return dataclasses.replace(spec, curve_every_steps=1 if curve else 0, curve_max_per_s=0.0)


def _plain_child(steps: int) -> dict[str, Any]:
    """The same training as DigitsMLP under the runtime, written as an ordinary loop."""
    wall, cpu = time.perf_counter(), time.process_time()
    x_train, y_train, x_test, y_test = digits_split()
    torch.manual_seed(SEED)
    model = build_mlp(FIXED["hidden"], 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=HP["lr"], momentum=HP["momentum"])
    gen = torch.Generator()
    gen.manual_seed(SEED)
    n, bs = x_train.shape[0], int(HP["bs"])
    perm, cursor = torch.randperm(n, generator=gen), 0
    metrics: dict[str, float] = {}
    for step in range(1, steps + 1):
        model.train()
        for _ in range(FIXED["minibatches"]):
            if cursor == n:
                perm, cursor = torch.randperm(n, generator=gen), 0
            idx = perm[cursor : cursor + bs]
            cursor += int(idx.shape[0])
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
        if step % EVAL_EVERY == 0:
            model.eval()
            with torch.no_grad():
                logits = model(x_test)
                metrics = {
                    "accuracy": (logits.argmax(dim=1) == y_test).float().mean().item(),
                    "loss": F.cross_entropy(logits, y_test).item(),
                }
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "metrics": metrics}


def _runtime_child(steps: int, curve: bool = True) -> dict[str, Any]:
    """The worker's path: ``run_batch`` with the worker's event writer (JSON lines, flushed per event)."""
    metrics: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as d, open(os.devnull, "w") as sink:
        write = EventWriter(sink)

        def emit(kind: str, payload: dict[str, Any]) -> None:
            write(kind, payload)
            if kind == "metrics":
                metrics.append(payload["metrics"])

        wall, cpu = time.perf_counter(), time.process_time()
        outcome = run_batch(_spec(steps, curve), DigitsMLP, LocalCheckpointStore(d), emit)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert outcome.status == "finished", outcome
    return {"wall": wall, "cpu": cpu, "metrics": metrics[-1]}


def _child(which: str, steps: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tests.bench.worker", "--child", which, "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _checkpoint_costs(tmp: Path, repeats: int = 7) -> tuple[float, float]:
    store = LocalCheckpointStore(tmp / "costs")  # fsync on, as in production
    trainer = DigitsMLP()
    trainer.bind(TrainerContext(fixed=FIXED, seed=SEED))
    seed_everything(SEED)
    trainer.init()
    trainer.setup(dict(HP))
    for _ in range(10):
        trainer.train()
    saves, loads = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        stored = store.put(f"bench/s{i}", take_snapshot(trainer, Point(1, 10)).write)
        saves.append(time.perf_counter() - t0)
        fresh = DigitsMLP()
        fresh.bind(TrainerContext(fixed=FIXED, seed=SEED))
        fresh.init()
        t0 = time.perf_counter()
        restore(fresh, store, stored.uri)
        loads.append(time.perf_counter() - t0)
    return statistics.median(saves) * 1e3, statistics.median(loads) * 1e3


def _resume_exact(tmp: Path) -> bool:
    store = LocalCheckpointStore(tmp / "exact")
    hp = {"lr": MultiStep(0.1, [20], 0.5), "momentum": 0.9, "bs": MultiStep(16, [15], 2)}
    fixed = {"dropout": 0.2}
    got: dict[str, list[tuple[str, dict[str, Any]]]] = {"straight": [], "head": [], "tail": []}

    def emit_to(name: str) -> Any:
        return lambda kind, payload: got[name].append((kind, payload))

    run_batch(
        digits_batch([(1, 0, 30, hp)], fixed_values=fixed, evals=[(1, 30)]), DigitsMLP, store, emit_to("straight")
    )
    run_batch(
        digits_batch([(1, 0, 10, hp)], fixed_values=fixed, saves=[(1, 10)], batch_id=2),
        DigitsMLP,
        store,
        emit_to("head"),
    )
    (uri,) = [p["uri"] for k, p in got["head"] if k == "checkpoint_saved"]
    spec = digits_batch(
        [(1, 10, 30, hp)], fixed_values=fixed, source=Source(Point(1, 10), uri), evals=[(1, 30)], batch_id=3
    )
    run_batch(spec, DigitsMLP, store, emit_to("tail"))
    a = [p["metrics"] for k, p in got["straight"] if k == "metrics"]
    b = [p["metrics"] for k, p in got["tail"] if k == "metrics"]
    return bool(a) and a == b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--child", choices=["runtime", "nocurve", "plain"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.child:
        # The first optimizer either loop builds imports torch._dynamo, which takes about as long as
        # importing torch: an import like the others, so it happens before the clock starts.
        importlib.import_module("torch._dynamo")
        digits_split()  # warm the data cache in both children alike (it is timed, but tiny)
        if args.child == "plain":
            print(json.dumps(_plain_child(args.steps)))
        else:
            print(json.dumps(_runtime_child(args.steps, curve=args.child == "runtime")))
        return 0

    runtime_s, plain_s, runtime_cpu, plain_cpu, nocurve_s = [], [], [], [], []
    same_metrics = True
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(args.runs):
            order = ("runtime", "nocurve", "plain") if r % 2 == 0 else ("plain", "nocurve", "runtime")
            res = {which: _child(which, args.steps) for which in order}
            nocurve_s.append(res["nocurve"]["wall"])
            runtime_s.append(res["runtime"]["wall"])
            plain_s.append(res["plain"]["wall"])
            runtime_cpu.append(res["runtime"]["cpu"])
            plain_cpu.append(res["plain"]["cpu"])
            same_metrics &= res["runtime"]["metrics"] == res["plain"]["metrics"]
            print(
                f"run {r}: runtime {runtime_s[-1]:.3f} s, without curve {nocurve_s[-1]:.3f} s, "
                f"plain {plain_s[-1]:.3f} s (wall)",
                flush=True,
            )
        save_ms, load_ms = _checkpoint_costs(tmp)
        exact = _resume_exact(tmp)
    overhead = statistics.median(runtime_s) / statistics.median(plain_s)
    cpu_overhead = statistics.median(runtime_cpu) / statistics.median(plain_cpu)
    per_step_ms = statistics.median(plain_s) / args.steps * 1e3
    print(
        f"steps={args.steps} runs={args.runs} plain_step_ms={per_step_ms:.3f} "
        f"cpu_time_overhead={cpu_overhead:.3f} same_metrics_as_plain={str(same_metrics).lower()} "
        f"curve_overhead={statistics.median(runtime_s) / statistics.median(nocurve_s):.3f} "
        f"runtime_overhead_without_curve={statistics.median(nocurve_s) / statistics.median(plain_s):.3f}"
    )
    line = (
        f"runtime_overhead={overhead:.3f} ckpt_save_ms={save_ms:.2f} ckpt_load_ms={load_ms:.2f} "
        f"resume_exact={str(exact).lower()}"
    )
    print(record("worker", line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
