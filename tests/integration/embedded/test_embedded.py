"""The embedded mode end to end through the SDK, with real worker processes training a real PyTorch
model: trials that share a schedule prefix train it once (executed steps = unique steps), and every
trial's metrics equal an independent straight run of that trial from scratch (same seed) to 1e-6."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import stagetree
from stagetree.core.sequences import MultiStep
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.nodemanager.examples.digits import ENTRY_POINT, DigitsMLP, digits_batch
from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
from stagetree.nodemanager.runtime.executor import run_batch

VALUES = {"hidden": 32, "minibatches": 2}
BRANCH, END = 10, 20


def straight_run(hps: dict[str, Any], step: int, tmp: Path) -> dict[str, float]:
    got: dict[str, float] = {}

    def emit(kind: str, payload: dict[str, Any]) -> None:
        if kind == "metrics":
            got.update(payload["metrics"])

    spec = digits_batch([(1, 0, step, hps)], evals=[(1, step)], fixed_values=VALUES, seed=0)
    outcome = run_batch(spec, DigitsMLP, LocalCheckpointStore(tmp), emit)
    assert outcome.status == "finished"
    return got


async def _executed_steps(cluster: Embedded, expected: int, timeout_s: float = 30.0) -> int:
    """The steps of the plan's batches that are done, once they reach ``expected`` (or the deadline)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        executed: int = await asyncio.to_thread(cluster.app.store.batches.executed_steps)
        if executed >= expected or asyncio.get_running_loop().time() > deadline:
            return executed
        await asyncio.sleep(0.05)


async def test_embedded_study_shares_prefixes_and_matches_straight_runs(tmp_path: Path) -> None:
    configs = [{"lr": MultiStep(0.1, [BRANCH], gamma), "bs": 32} for gamma in (0.5, 0.1, 0.01)]
    async with (
        Embedded(EmbeddedSettings(home=tmp_path / "home", workers=2)) as cluster,
        stagetree.connect(cluster.target, token=cluster.token) as client,
    ):
        study = await stagetree.Study.create(
            client, "embedded-test", trainer=ENTRY_POINT, seed=0, values=VALUES, tuned=["lr", "bs"]
        )
        results = await asyncio.wait_for(asyncio.gather(*(study.eval(c, END) for c in configs)), 120)
        again = await study.eval(configs[0], END)  # answered from the stored metrics
        assert client.rpc_count < 10
        # A request is answered by its batch's metrics, which may be applied before its end: counted
        # once every batch is done.
        expected = BRANCH + len(configs) * (END - BRANCH)  # the shared prefix trained once
        executed = await _executed_steps(cluster, expected)
    assert executed == expected
    assert again == results[0]
    for cfg, got in zip(configs, results, strict=True):
        want = straight_run(cfg, END, tmp_path / "straight")
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], abs=1e-6), (cfg, k)
