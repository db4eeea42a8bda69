"""Warm workers, end to end through a ``NodeManager`` with real worker processes training digits: a worker
runs batch after batch with the trainer's module imported once, a batch that starts where the last one
ended continues from memory with the metrics of a checkpointed resume (bit for bit), and a worker is
replaced after a failure, a preemption, or for another code version; the node manager preloads the
trainer module of its work in the workers started ahead."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from stagetree.bus.messages import Curve
from stagetree.core.batch import BatchSpec, Point, Source
from stagetree.core.sequences import MultiStep
from stagetree.nodemanager.examples.digits import DigitsMLP, digits_batch
from stagetree.nodemanager.examples.faults import ENTRY_POINT as FAULTY
from stagetree.nodemanager.link import PREEMPT
from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
from stagetree.nodemanager.runtime.executor import run_batch
from tests.unit.nodemanager.harness import Harness, spec_of, start_node_manager, until

pytestmark = pytest.mark.timeout(600)

# A user's trainer module that counts its imports: one line (the importing process's pid) per import,
# and one per init, in files beside it.
COUNTED = """
import os
from pathlib import Path

from stagetree.nodemanager.examples.digits import DigitsMLP

_HERE = Path(__file__)
with open(_HERE.with_suffix(".imports"), "a") as f:
    f.write(f"{os.getpid()}\\n")


class Counted(DigitsMLP):
    prepare_ahead = False  # its init writes a file

    def init(self):
        with open(_HERE.with_suffix(".inits"), "a") as f:
            f.write(f"{os.getpid()}\\n")
        super().init()
"""
COUNTED_ENTRY = "counted_trainer:Counted"


def _counted(tmp: Path) -> tuple[Path, Path]:
    (tmp / "counted_trainer.py").write_text(COUNTED)
    return tmp / "counted_trainer.imports", tmp / "counted_trainer.inits"


def _lines(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _versioned(spec: BatchSpec, code_version: str) -> BatchSpec:
    fixed = replace(spec.fixed, code_version=code_version)
    return replace(spec, fixed=fixed, plan_key=fixed.key())


def _worker_pids(caplog: pytest.LogCaptureFixture) -> dict[int, int]:
    """batch id -> the pid of the worker the node manager handed it to (its "worker started" records)."""
    return {
        int(r.batch_id): int(r.pid)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "stagetree.nodemanager.agent" and r.getMessage() == "worker started"
    }


async def _started(tmp: Path, **kw: Any) -> Harness:
    """A node manager whose workers are up (the fork server imports torch: on a loaded machine, a while)."""
    h = await start_node_manager(tmp, **kw)
    await asyncio.wait_for(h.nm.workers_ready(), 300)
    return h


async def _report(h: Harness, batch_id: int) -> Any:
    return await h.report(batch_id, timeout=120)


async def _stop(h: Harness) -> None:
    h.stop.set()
    await asyncio.wait_for(h.task, 120)


async def test_a_worker_runs_batch_after_batch_importing_the_trainer_once_until_the_code_version_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stagetree.nodemanager.agent")
    imports, inits = _counted(tmp_path)
    h = await _started(tmp_path, user_path=tmp_path)
    specs = [
        _versioned(spec_of(1, steps=3, trainer=COUNTED_ENTRY, hidden=16), "v1"),
        _versioned(spec_of(2, steps=3, trainer=COUNTED_ENTRY, hidden=24), "v1"),
        _versioned(spec_of(3, steps=3, trainer=COUNTED_ENTRY, hidden=16), "v2"),  # the trainer was edited
    ]
    try:
        for spec in specs:
            h.run(spec)
            assert (await _report(h, spec.batch_id)).ok
    finally:
        await _stop(h)
    pids = _worker_pids(caplog)
    assert pids[1] == pids[2] != pids[3]
    assert _lines(inits) == [pids[1], pids[1], pids[3]]  # a trainer built per batch (each starts fresh)
    assert _lines(imports) == [pids[1], pids[3]]  # its module imported once per worker


async def test_a_batch_that_starts_where_the_last_ended_continues_from_memory_as_from_its_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stagetree.nodemanager.agent")
    # the learning rate and the batch size change inside both batches; dropout draws from the torch RNG
    hp = {"lr": MultiStep(0.1, [8], 0.5), "momentum": 0.9, "bs": MultiStep(16, [4, 10], 2)}
    fixed = {"dropout": 0.2, "hidden": 32}
    head = digits_batch([(1, 0, 6, hp)], batch_id=1, fixed_values=fixed, saves=[(1, 6)], evals=[(1, 6)])
    h = await _started(tmp_path)
    try:
        h.run(head)
        (checkpoint,) = (await _report(h, 1)).checkpoints
        tail = digits_batch(
            [(1, 6, 12, hp)],
            batch_id=2,
            fixed_values=fixed,
            source=Source(Point(1, 6), checkpoint.uri),
            evals=[(1, 12)],
        )
        h.run(tail)
        from_memory = await _report(h, 2)
        h.run(replace(tail, batch_id=3))  # the same batch again: this worker's trainer is at step 12 now
        from_checkpoint = await _report(h, 3)
    finally:
        await _stop(h)
    pids = _worker_pids(caplog)
    assert pids[1] == pids[2] == pids[3]
    logs = tmp_path / "work" / "logs"
    assert "continues from memory" in (logs / "batch-2-a1.log").read_text()
    assert "continues from memory" not in (logs / "batch-3-a1.log").read_text()

    def metrics(report: Any) -> list[tuple[int, dict[str, float]]]:
        return [(m.step, dict(m.metrics)) for m in report.metrics]

    def curve(report: Any) -> list[tuple[int, dict[str, float]]]:
        return [(s, dict(v)) for m in report.of_type(Curve) for s, v in zip(m.steps, m.values, strict=True)]

    assert from_memory.ok and from_checkpoint.ok
    assert metrics(from_memory) == metrics(from_checkpoint)  # exactly: floats compared with ==
    assert curve(from_memory) == curve(from_checkpoint) and len(curve(from_memory)) == 6
    # and both are the straight run's
    straight: dict[str, float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec = digits_batch([(1, 0, 12, hp)], fixed_values=fixed, evals=[(1, 12)])
        run_batch(
            spec,
            DigitsMLP,
            LocalCheckpointStore(tmp_path / "straight"),
            lambda kind, p: straight.update(p["metrics"]) if kind == "metrics" else None,
        )
    finally:
        torch.set_num_threads(threads)
    assert metrics(from_memory) == [(12, straight)]


async def test_a_worker_whose_batch_failed_or_was_preempted_is_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stagetree.nodemanager.agent")
    h = await _started(tmp_path)
    try:
        h.run(spec_of(1, steps=3, trainer=FAULTY))
        assert (await _report(h, 1)).ok
        h.run(spec_of(2, steps=3, trainer=FAULTY, fault="raise", fault_step=1))
        failed = await _report(h, 2)
        assert not failed.ok and failed.user_error and "injected fault" in failed.error
        h.run(spec_of(3, steps=3, trainer=FAULTY))
        assert (await _report(h, 3)).ok
        h.run(spec_of(4, steps=400, trainer=FAULTY, sleep_s=0.02))
        await until(lambda: h.nm._attempts.get((4, 1)) and h.nm._attempts[(4, 1)].started)
        h.send(PREEMPT, 4)
        assert (await _report(h, 4)).preempted
        h.run(spec_of(5, steps=3, trainer=FAULTY))
        assert (await _report(h, 5)).ok
    finally:
        await _stop(h)
    pids = _worker_pids(caplog)
    assert pids[1] == pids[2] != pids[3]  # the failure happened on batch 1's worker, which went with it
    assert pids[4] == pids[3] and pids[5] != pids[4]  # a preempted batch's worker goes too


async def test_workers_waiting_on_other_slots_import_the_trainer_of_the_work_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stagetree.nodemanager.agent")
    imports, _ = _counted(tmp_path)
    h = await _started(tmp_path, slots=2, user_path=tmp_path)
    try:
        h.run(spec_of(1, steps=3, trainer=COUNTED_ENTRY), slot_id="cpu0")
        assert (await _report(h, 1)).ok
        # cpu1's worker, started ahead, imported the module of the work cpu0 was sent, with no batch of its own
        await until(lambda: len(_lines(imports)) == 2, timeout=60)
        h.run(spec_of(2, steps=3, trainer=COUNTED_ENTRY), slot_id="cpu1")
        assert (await _report(h, 2)).ok
    finally:
        await _stop(h)
    pids = _worker_pids(caplog)
    assert pids[1] != pids[2]
    assert sorted(_lines(imports)) == sorted([pids[1], pids[2]])  # not again for its batch


# A trainer that writes what the cyclic collector sees in the worker that builds it.
GC_PROBE = """
import gc
from pathlib import Path

from stagetree.nodemanager.examples.digits import DigitsMLP


class Probe(DigitsMLP):
    prepare_ahead = False

    def init(self):
        seen = f"{gc.isenabled()} {gc.get_freeze_count()} {len(gc.get_objects())}"
        Path(__file__).with_suffix(".gc").write_text(seen)
        super().init()
"""


async def test_a_worker_keeps_what_it_imported_out_of_the_collectors_scans(tmp_path: Path) -> None:
    (tmp_path / "gc_probe.py").write_text(GC_PROBE)
    h = await _started(tmp_path, user_path=tmp_path)
    try:
        h.run(spec_of(1, steps=2, trainer="gc_probe:Probe", hidden=16))
        assert (await _report(h, 1)).ok
    finally:
        await _stop(h)
    enabled, frozen, tracked = (tmp_path / "gc_probe.gc").read_text().split()
    assert enabled == "True"  # the batch's own garbage is still collected
    # torch's and the runtime's objects (hundreds of thousands) are frozen; what the collector tracks is
    # what was made since (the trainer's module, the batch)
    assert int(frozen) > 100_000 > int(tracked)
