"""``NodeManager`` running batches on several slots as one group of real rank processes (gloo on CPU
slots): one report per attempt, a rank's death or failure ends every rank and frees every slot, a
preemption stops all ranks at one step, and a batch asking for more slots than there are is refused, as is
one whose ranks would share a GPU (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from stagetree.core.batch import BatchSpec
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.agent import rank_slots
from stagetree.nodemanager.examples.digits import digits_batch
from stagetree.nodemanager.examples.faults import TORCH_ENTRY_POINT
from stagetree.nodemanager.group import WorkerGroup
from stagetree.nodemanager.link import PREEMPT
from tests.unit.nodemanager.harness import Harness, start_node_manager, until

pytestmark = pytest.mark.timeout(120)

HP = {"lr": 0.1, "momentum": 0.9, "bs": 32}


def _spec(batch_id: int, steps: int = 10, slots: int = 2, **fixed: Any) -> BatchSpec:
    spec = digits_batch(
        [(1, 0, steps, HP)],
        batch_id=batch_id,
        trainer=TORCH_ENTRY_POINT,
        fixed_values=fixed,
        evals=[(1, steps)],
        saves=[(1, steps)],
    )
    return dataclasses.replace(spec, slots=slots)


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture(params=["forkserver", "exec"])
async def h(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start_node_manager(tmp_path, slots=2, launcher=request.param)
    yield harness
    harness.stop.set()
    await asyncio.wait_for(harness.task, 30)


async def _group(h: Harness, batch_id: int) -> WorkerGroup:
    await until(lambda: h.nm._attempts.get((batch_id, 1)) and h.nm._attempts[(batch_id, 1)].started, 60)
    group = h.nm._attempts[(batch_id, 1)].worker
    assert isinstance(group, WorkerGroup)
    return group


async def test_a_two_slot_batch_trains_as_two_ranks_and_is_reported_once(h: Harness) -> None:
    h.run(_spec(1))
    report = await h.report(1, timeout=60)
    assert report.ok, report.error
    assert [(m.step, sorted(m.metrics)) for m in report.metrics] == [(10, ["accuracy", "loss"])]
    assert [(c.step, c.kind) for c in report.checkpoints] == [(10, "central")]
    logs = h.tmp / "work" / "logs"
    assert (logs / "batch-1-a1-r0.log").exists() and (logs / "batch-1-a1-r1.log").exists()
    await until(lambda: sorted(h.nm._free) == ["cpu0", "cpu1"])
    assert len([r for r in h.link.reports if r.batch_id == 1]) == 1


async def test_a_killed_rank_ends_every_rank_frees_the_slots_and_fails_the_attempt(h: Harness) -> None:
    h.run(_spec(2, steps=400, sleep_s=0.02))
    group = await _group(h, 2)
    pids = group.pids
    os.kill(pids[1], signal.SIGKILL)
    report = await h.report(2, timeout=60)
    assert not report.ok and not report.preempted and not report.user_error
    assert "rank 1 of 2" in report.error and "SIGKILL" in report.error, report.error
    assert all(gone(p) for p in pids), [p for p in pids if not gone(p)]
    await until(lambda: sorted(h.nm._free) == ["cpu0", "cpu1"] and h.nm.running() == [])
    h.run(_spec(3, steps=3))  # both slots are free again: the next group starts at once
    assert (await h.report(3, timeout=60)).ok


async def test_a_rank_out_of_memory_fails_the_attempt_as_out_of_memory(h: Harness) -> None:
    h.run(_spec(4, steps=30, fault="runtime_oom", fault_step=2, fault_rank=1))
    report = await h.report(4, timeout=60)
    assert not report.ok and report.oom and not report.user_error
    assert "out of memory" in report.error
    await until(lambda: sorted(h.nm._free) == ["cpu0", "cpu1"])


async def test_a_preempted_group_stops_every_rank_at_one_step_with_one_checkpoint(h: Harness) -> None:
    h.run(_spec(5, steps=400, sleep_s=0.02))
    group = await _group(h, 5)
    h.send(PREEMPT, 5)
    report = await h.report(5, timeout=60)
    assert report.preempted and not report.ok
    (ckpt,) = report.checkpoints
    assert ckpt.kind == "peripheral" and 1 <= ckpt.step < 400 and h.store.exists(ckpt.uri)
    assert all(gone(p) for p in group.pids)
    assert [w.returncode for w in group.workers] == [0, 0]


async def test_a_batch_on_more_slots_than_the_node_manager_has_is_refused(h: Harness) -> None:
    h.run(_spec(6, slots=3))
    report = await h.report(6)
    assert not report.ok and "asks for 3 slots" in report.error and "has 2" in report.error
    h.run(_spec(7, steps=3, slots=1))  # and the queue goes on
    assert (await h.report(7, timeout=60)).ok


def test_ranks_of_one_batch_take_slots_of_distinct_gpus_hinted_first() -> None:
    g00, g01 = SlotInfo("gpu0.0", "H200", gpu_index=0), SlotInfo("gpu0.1", "H200", gpu_index=0)
    g10, g11 = SlotInfo("gpu1.0", "H200", gpu_index=1), SlotInfo("gpu1.1", "H200", gpu_index=1)
    free = {s.id: s for s in (g00, g01, g10, g11)}
    assert rank_slots(2, [], free) == [g00, g10]
    assert rank_slots(2, [g11], free) == [g11, g00]
    assert rank_slots(2, [], {g00.id: g00, g01.id: g01}) is None  # two slots of one GPU hold one rank
    assert rank_slots(1, [g01], free) == [g01]
    cpu = {f"cpu{i}": SlotInfo(f"cpu{i}") for i in range(3)}
    assert [s.id for s in rank_slots(3, [], cpu) or []] == ["cpu0", "cpu1", "cpu2"]  # CPU ranks: any slots


async def test_a_batch_whose_ranks_would_share_the_one_gpu_is_refused_with_why(tmp_path: Path) -> None:
    shared = [SlotInfo(f"gpu0.{i}", "H200", memory_bytes=2**30, share=0.5, gpu_index=0) for i in range(2)]
    h = await start_node_manager(tmp_path, slot_infos=shared)
    try:
        h.run(_spec(8, slots=2))
        report = await h.report(8)
        assert not report.ok and "asks for 2 ranks" in report.error and "1 GPU(s)" in report.error
        assert "never share a GPU" in report.error and not h.nm._attempts
        assert sorted(h.nm._free) == ["gpu0.0", "gpu0.1"]  # nothing started, both slots free
    finally:
        h.stop.set()
        await asyncio.wait_for(h.task, 30)
