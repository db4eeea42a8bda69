"""Batches on several slots end to end in embedded mode, with real rank processes (gloo on CPU slots): a
study's ``slots`` trains each batch on that many ranks; an out of memory doubles the slots of the retry;
past the largest node manager the request fails saying why; a killed rank fails its attempt, leaves
no rank behind, and the work is retried."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

import stagetree
from stagetree.client.sdk import EvalFailed
from stagetree.core.sequences import Constant
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.master.store import models as m
from stagetree.nodemanager.examples.faults import TORCH_ENTRY_POINT
from stagetree.nodemanager.group import WorkerGroup
from tests.integration.nodemanager.helpers import until
from tests.unit.nodemanager.test_group import gone

pytestmark = pytest.mark.timeout(240)

CFG = {"lr": Constant(0.1), "bs": Constant(32)}


def _batches(cluster: Embedded) -> list[tuple[str, int, tuple[str, ...]]]:
    """(state, slots, slot ids in rank order) of every batch, in order."""
    with cluster.app.store.db.tx("test: batches") as s:
        rows = s.execute(select(m.Batch.id, m.Batch.state, m.Batch.spec_json).order_by(m.Batch.id)).all()
        held = s.execute(select(m.BatchSlot.batch_id, m.BatchSlot.slot_id).order_by(m.BatchSlot.rank)).all()
    slots: dict[int, tuple[str, ...]] = {}
    for bid, slot in held:
        slots[bid] = (*slots.get(bid, ()), str(slot))
    return [(str(st), int(json.loads(spec).get("slots", 1)), slots.get(bid, ())) for bid, st, spec in rows]


def _settings(tmp: Path, workers: int) -> EmbeddedSettings:
    return EmbeddedSettings(home=tmp / "home", workers=workers)


async def _ended(cluster: Embedded) -> list[tuple[str, int, tuple[str, ...]]]:
    """``_batches`` once none is running: a result is written (and delivered) before its batch's end."""

    def ended() -> list[tuple[str, int, tuple[str, ...]]] | None:
        batches = _batches(cluster)
        return batches if all(st != "RUNNING" for st, _, _ in batches) else None

    got: list[tuple[str, int, tuple[str, ...]]] = await until(ended, 30, "no batch running")
    return got


async def _study(client: Any, name: str, policies: dict[str, Any] | None = None, **values: Any) -> Any:
    return await stagetree.Study.create(
        client, name, trainer=TORCH_ENTRY_POINT, values=values, tuned=["lr", "bs"], policies=policies
    )


async def test_a_study_trains_each_batch_on_the_slots_it_asks_for(tmp_path: Path) -> None:
    async with Embedded(_settings(tmp_path, 2)) as cluster, stagetree.connect(cluster.target, token=cluster.token) as c:
        two = await _study(c, "two", {"slots": 2})
        got = await asyncio.wait_for(two.eval(CFG, 6), 120)
        assert set(got) == {"accuracy", "loss"}
        assert await _ended(cluster) == [("DONE", 2, ("cpu0", "cpu1"))]


async def test_an_out_of_memory_doubles_the_slots_of_the_retry(tmp_path: Path) -> None:
    once = tmp_path / "oom-once"
    async with Embedded(_settings(tmp_path, 2)) as cluster, stagetree.connect(cluster.target, token=cluster.token) as c:
        study = await _study(c, "oom", fault="runtime_oom", fault_step=2, fault_once=str(once))
        got = await asyncio.wait_for(study.eval(CFG, 6), 120)
        assert set(got) == {"accuracy", "loss"} and once.exists()
        (oom, done) = await _ended(cluster)
        assert oom[:2] == ("OUT_OF_MEMORY", 1) and done == ("DONE", 2, ("cpu0", "cpu1"))


async def test_a_retry_on_two_slots_resumes_a_one_rank_checkpoint_and_the_plan_records_the_path_change(
    tmp_path: Path,
) -> None:
    """The natural rescale (issue 22): a 1-slot batch saves at step 3; the next one resumes it on 1 slot
    (no change) and runs out of memory at step 4; its retry on 2 slots resumes that 1-rank checkpoint
    (the trainer is rescalable): one path change, at step 3, from 1 rank to 2, by the retry."""
    once = tmp_path / "oom-once"
    async with Embedded(_settings(tmp_path, 2)) as cluster, stagetree.connect(cluster.target, token=cluster.token) as c:
        study = await _study(c, "rescale", fault="runtime_oom", fault_step=4, fault_once=str(once))
        await asyncio.wait_for(study.eval(CFG, 3), 120)
        got = await asyncio.wait_for(study.eval(CFG, 6), 120)
        assert set(got) == {"accuracy", "loss"} and once.exists()
        assert [(st, n) for st, n, _ in await _ended(cluster)] == [("DONE", 1), ("OUT_OF_MEMORY", 1), ("DONE", 2)]
        with cluster.app.store.db.tx("test: path changes") as s:
            p = m.PathChange
            changes = s.execute(select(p.batch_id, p.step, p.from_ranks, p.to_ranks, p.node_manager_id)).all()
            last = s.scalar(select(func.max(m.Batch.id)))
            # the central checkpoints (the steps inside a batch are kept too, as one pack of snapshots)
            central = select(m.Checkpoint.step, m.Checkpoint.ranks).where(m.Checkpoint.kind == "central")
            ranks = dict(s.execute(central).all())
        assert [tuple(r)[:4] for r in changes] == [(last, 3, 1, 2)]
        assert ranks == {3: 1, 6: 2}


async def test_an_out_of_memory_on_every_slot_of_the_largest_node_manager_fails_saying_why(tmp_path: Path) -> None:
    async with Embedded(_settings(tmp_path, 2)) as cluster, stagetree.connect(cluster.target, token=cluster.token) as c:
        study = await _study(c, "always-oom", fault="runtime_oom", fault_step=1)
        with pytest.raises(EvalFailed) as err:
            await asyncio.wait_for(study.eval(CFG, 4), 120)
        assert "out of memory on 2 slot(s): the retry would take 4 slots" in err.value.message
        assert "largest node manager has 2" in err.value.message
        assert [(st, n) for st, n, _ in await _ended(cluster)] == [("OUT_OF_MEMORY", 1), ("OUT_OF_MEMORY", 2)]


async def test_a_killed_rank_fails_its_attempt_and_the_work_is_retried(tmp_path: Path) -> None:
    """A rank killed by SIGKILL that nobody here sent reads as the out-of-memory killer (as for a one-slot
    worker), so the retry takes twice the slots: 4 on this 4-slot node manager."""
    async with Embedded(_settings(tmp_path, 4)) as cluster, stagetree.connect(cluster.target, token=cluster.token) as c:
        study = await _study(c, "killed", {"slots": 2}, sleep_s=0.05)
        task = asyncio.ensure_future(study.eval(CFG, 60))
        nm = cluster.node_manager
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        group = None
        while group is None:
            assert loop.time() < deadline and not task.done()
            atts = [a for a in nm._attempts.values() if a.started and isinstance(a.worker, WorkerGroup)]
            group = atts[0].worker if atts else None
            await asyncio.sleep(0.05)
        assert isinstance(group, WorkerGroup)
        pids = group.pids
        os.kill(pids[1], signal.SIGKILL)
        got = await asyncio.wait_for(task, 180)
        assert set(got) == {"accuracy", "loss"}
        assert all(gone(p) for p in pids)
        first, *rest = await _ended(cluster)
        assert first[:2] == ("OUT_OF_MEMORY", 2) and rest[-1][:2] == ("DONE", 4)
