"""Client SDK benchmark: ``python -m tests.bench.client``.

The platform runs as the embedded mode will (master on SQLite in a temp dir, in-process coordination,
gRPC on a free port, its scheduling loop) with a no-op node manager that trains nothing but speaks the
real node-manager RPCs, so only the platform is measured (``tests/integration/client/harness.py``).

1. 2,000 concurrent evals from one asyncio client: a TreeML-style grid study (200 trials: 20
   learning-rate x 10 batch-size schedules whose prefixes overlap), each trial evaluated at 10 points of
   its learning curve (steps 10, 20, ..., 100), all submitted at once with ``asyncio.gather``.
   ``evals_per_s`` = 2,000 / the time until the last one returned; ``rpcs_per_eval`` = the client's RPCs
   in that phase / 2,000 (SubmitRequests and StreamResults; batching makes it small).
2. An ASHA study driven live (``stagetree.drive``): ``asha_promotions_ok`` is whether every decision of
   the run (its trace of results and submits) matches an independent re-implementation of Li et al.'s
   Algorithm 2 on the same results (``tests.sim.asha_check.check_asha_trace``).

Last line: ``evals_per_s=<n> rpcs_per_eval=<r> asha_promotions_ok=<true|false> evals_vs_grpc_unary=<q>``
(targets: >= 1000, <= 0.1, true); the last field is evals a second over bare gRPC unary round trips a
second on loopback, measured in the same run (``tests.bench.refs``).

The platform under test is the ``PLATFORM`` line below: a function of a work directory returning an
async context manager that yields a ``Target`` (gRPC address and token). ``PLATFORM = embedded_platform``
(or ``--platform embedded``) measures the real embedded mode instead, whose worker processes run
``TRAINER``, a no-op ``Trainer``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

import stagetree
from stagetree.client.spaces import Choice, GridSearchSpace, LogUniform, RandomSearchSpace
from stagetree.client.tuners import ASHA
from stagetree.core.config import Config
from stagetree.core.sequences import MultiStep
from stagetree.master.settings import AuthSettings, LimitSettings, MasterSettings
from stagetree.master.store.schema import upgrade
from stagetree.master.store.store import make_engine
from tests.bench import refs
from tests.bench.record import record
from tests.integration.client.harness import in_process_master, metrics_of_values
from tests.sim.asha_check import check_asha_trace

TOKEN = "bench-token"
TRAINER = "tests.bench.client:NoopTrainer"
SLOTS = 8
TIMEOUT_S = 300.0  # a phase that takes longer fails the bench instead of hanging it


@dataclass(frozen=True)
class Target:
    grpc: str
    token: str
    stats: Callable[[], dict[str, int]] = dict  # what the platform ran, when it can tell


@asynccontextmanager
async def noop_platform(workdir: Path) -> AsyncIterator[Target]:
    """Master (SQLite in ``workdir``) + no-op node manager with ``SLOTS`` slots, in this event loop."""
    url = f"sqlite:///{workdir / 'stagetree.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    settings = MasterSettings(
        database_url=url,
        auth=AuthSettings(tokens={"bench": SecretStr(TOKEN)}, admin_token=SecretStr("bench-admin")),
        limits=LimitSettings(max_batch_items=1000),
    )
    async with in_process_master(settings, slots=SLOTS) as p:
        nm = p.node_manager
        yield Target(p.grpc_target, TOKEN, lambda: {"batches": len(nm.batches), "trained_steps": nm.trained_steps})


@asynccontextmanager
async def embedded_platform(workdir: Path) -> AsyncIterator[Target]:
    """The real embedded mode (``stagetree up``): worker processes run ``TRAINER``, which trains nothing."""
    from stagetree.embedded import Embedded, EmbeddedSettings

    async with Embedded(EmbeddedSettings(home=workdir, workers=SLOTS)) as cluster:
        yield Target(cluster.target, cluster.token)


PLATFORMS: dict[str, Callable[[Path], AbstractAsyncContextManager[Target]]] = {
    "noop": noop_platform,
    "embedded": embedded_platform,
}
# The platform under test: the one line to change for the embedded mode (or pass --platform embedded).
PLATFORM: Callable[[Path], AbstractAsyncContextManager[Target]] = noop_platform


def __getattr__(name: str) -> Any:
    """``NoopTrainer``, built on first use so that this module does not import torch otherwise."""
    if name != "NoopTrainer":
        raise AttributeError(name)
    from stagetree.nodemanager.runtime.trainer import Trainer

    class NoopTrainer(Trainer):
        """Trains nothing; reports the same metrics as the no-op node manager."""

        def init(self) -> None:
            self.values: dict[str, Any] = {}

        def setup(self, hp_changes: dict[str, Any]) -> None:
            self.values.update(hp_changes)

        def train(self) -> None:
            pass

        def evaluate(self) -> dict[str, float]:
            return metrics_of_values(self.values, self.step)

        def state_dict(self) -> dict[str, Any]:
            return {"values": dict(self.values)}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.values = dict(state["values"])

    globals()["NoopTrainer"] = NoopTrainer
    return NoopTrainer


def grid() -> GridSearchSpace:
    lrs = [MultiStep(init, [m], 0.1) for init in (0.1, 0.05, 0.02, 0.01, 0.005) for m in (20, 40, 60, 80)]
    bss: list[Any] = [32, 64, 128]
    bss += [MultiStep(32, [m], 2) for m in (20, 40, 60, 80)] + [MultiStep(64, [m], 2) for m in (30, 60, 90)]
    return GridSearchSpace({"lr": lrs, "bs": bss})


def distinct_points(evals: list[tuple[dict[str, Any], int]]) -> int:
    """How many different (prefix, step) points the evals name: two evals whose configs agree before their
    step are one point of the search plan, trained and evaluated once."""
    seen = set()
    for cfg, step in evals:
        c = Config.of(cfg)
        seen.add(
            (step, tuple((n, tuple(seg[:1] + seg[2:] for seg in segs if seg.start < step)) for n, segs in c.items))
        )
    return len(seen)


async def concurrent_evals(client: stagetree.Client, points: int) -> tuple[float, float, int, float]:
    study = await stagetree.Study.create(client, "grid", trainer=TRAINER, dataset="bench", tuned=["lr", "bs"])
    space = grid()
    steps = [100 * (k + 1) // points for k in range(points)]
    evals = [(cfg, s) for cfg in space for s in steps]
    before = client.rpc_count
    t0 = time.perf_counter()
    results = await asyncio.wait_for(asyncio.gather(*(study.eval(cfg, s) for cfg, s in evals)), TIMEOUT_S)
    elapsed = time.perf_counter() - t0
    assert len(results) == len(evals) and all("acc" in r for r in results)
    rpcs = client.rpc_count - before
    return len(evals) / elapsed, rpcs / len(evals), distinct_points(evals), elapsed


async def asha_run(client: stagetree.Client) -> tuple[bool, int, float, list[str]]:
    study = await stagetree.Study.create(client, "asha", trainer=TRAINER, dataset="bench", seed=1, tuned=["lr", "bs"])
    space = RandomSearchSpace({"lr": LogUniform(1e-3, 1.0), "bs": Choice([32, 64, 128])}, seed=0)
    params = {"eta": 3, "min_step": 1, "max_step": 27, "max_concurrent": 16, "max_trials": 60}
    tuner = ASHA(space, metric="acc", mode="max", **params)
    t0 = time.perf_counter()
    run = await asyncio.wait_for(stagetree.drive(study, tuner), TIMEOUT_S)
    elapsed = time.perf_counter() - t0
    problems = check_asha_trace(run.trace, metric="acc", mode="max", **params)
    return tuner.finished and not problems, len(run.jobs), elapsed, problems


async def bench(points: int, platform: Callable[[Path], AbstractAsyncContextManager[Target]]) -> str:
    with tempfile.TemporaryDirectory(prefix="stagetree-bench-") as tmp:
        async with platform(Path(tmp)) as target, stagetree.connect(target.grpc, token=target.token) as client:
            rate, rpe, distinct, elapsed = await concurrent_evals(client, points)
            ran = target.stats()
            calls = dict(sorted(client.rpcs.items()))
            print(
                f"concurrent evals: {200 * points} ({distinct} distinct points) in {elapsed:.2f} s; "
                f"rpcs {calls}; platform ran {ran}"
            )
            ok, jobs, asha_s, problems = await asha_run(client)
            print(f"asha: {jobs} evals in {asha_s:.2f} s; promotions match the reference: {ok}")
            for p in problems[:10]:
                print(f"  {p}")
    unary = await refs.grpc_unary_rate()
    print(f"reference (same run): bare_grpc_unary_per_s={unary:.0f}")
    return (
        f"evals_per_s={rate:.0f} rpcs_per_eval={rpe:.4f} asha_promotions_ok={'true' if ok else 'false'}"
        f" evals_vs_grpc_unary={rate / unary:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=10, help="eval points per trial (200 trials)")
    parser.add_argument("--platform", choices=sorted(PLATFORMS), default=None, help="default: the PLATFORM line")
    ns = parser.parse_args()
    print(record("client", asyncio.run(bench(ns.points, PLATFORMS[ns.platform] if ns.platform else PLATFORM))))


if __name__ == "__main__":
    main()
