"""Simulated node managers: the real NodeManager over a FakeLink, with workers that only take time."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from stagetree.core.batch import BatchSpec, Point, Source
from stagetree.core.errors import InvalidArgument
from stagetree.core.simulator import synthetic_curve
from stagetree.nodemanager import simulated as sim
from stagetree.nodemanager.agent import NodeManager
from stagetree.nodemanager.examples.digits import digits_batch
from stagetree.nodemanager.link import ABORT, PREEMPT, RUN, Assignment, MasterLink
from stagetree.nodemanager.reporting import BatchReporter, GrpcReporter
from tests.unit.nodemanager.fakes import FakeLink

STEP_S = 0.01
HP = {"lr": 0.1}


@dataclass
class Fleet:
    nms: list[NodeManager]
    links: list[FakeLink]
    activity: sim.SlotActivity
    stop: asyncio.Event
    task: asyncio.Task[None]

    def run(self, i: int, spec: BatchSpec) -> None:
        self.links[i].feed.put_nowait(Assignment(spec.batch_id, spec.attempt, RUN, json.dumps(spec.to_json())))

    async def report(self, i: int, batch_id: int, timeout: float = 10) -> object:
        deadline = time.monotonic() + timeout
        while not any(r.batch_id == batch_id for r in self.links[i].reports):
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.005)
        return self.links[i].report_of(batch_id)


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    links: list[FakeLink] = []

    def link() -> MasterLink:
        links.append(FakeLink())
        return links[-1]

    def reporter(lk: MasterLink, _nm: str) -> BatchReporter:
        return GrpcReporter(lk, initial_backoff_s=0.01)

    spec = sim.FleetSpec(
        2, gpus=2, gpu_types=(sim.GpuType("fast", 1.0), sim.GpuType("slow", 0.25)), model=sim.SimulationModel(STEP_S)
    )
    activity = sim.SlotActivity()
    nms = sim.build_fleet(spec, link, reporter, activity)
    stop = asyncio.Event()
    task = asyncio.create_task(sim.run_fleet(nms, stop))
    while not all(nm.connected.is_set() for nm in nms):
        await asyncio.sleep(0.005)
    yield Fleet(nms, links, activity, stop, task)
    stop.set()
    await asyncio.wait_for(task, 10)


def _spec(batch_id: int, steps: int = 20, **kw: object) -> BatchSpec:
    return digits_batch([(1, 0, steps, HP)], batch_id=batch_id, **kw)  # type: ignore[arg-type]


async def test_fleet_registers_each_node_manager_with_its_gpu_slots(fleet: Fleet) -> None:
    regs = [lk.registrations[0] for lk in fleet.links]
    assert [r[0] for r in regs] == ["sim-0", "sim-1"]
    assert [[s.gpu_type for s in r[1]] for r in regs] == [["fast", "fast"], ["slow", "slow"]]
    assert all(s.is_gpu for r in regs for s in r[1])


async def test_a_batch_reports_the_curve_at_its_evals_and_its_saves_and_takes_its_steps_time(fleet: Fleet) -> None:
    spec = digits_batch(
        [(1, 0, 10, HP), (2, 10, 20, {"lr": 0.05})], batch_id=7, evals=[(1, 5), (2, 20)], saves=[(1, 10), (2, 20)]
    )
    t0 = time.monotonic()
    fleet.run(0, spec)
    report = await fleet.report(0, 7)
    took = time.monotonic() - t0
    assert report.ok and not report.preempted  # type: ignore[attr-defined]
    curve = synthetic_curve(0)
    stage = {s.node: s.config for s in spec.stages}
    got = {(m.node, m.step): m.metrics["loss"] for m in report.metrics}  # type: ignore[attr-defined]
    assert got == {(1, 5): curve(stage[1], 5), (2, 20): curve(stage[2], 20)}
    assert {(c.node, c.step) for c in report.checkpoints} == {(1, 10), (2, 20)}  # type: ignore[attr-defined]
    assert all(c.uri.startswith("sim://sim-0/") for c in report.checkpoints)  # type: ignore[attr-defined]
    assert took >= 20 * STEP_S
    [(nm, _slot, a, b, batch, attempt)] = fleet.activity.intervals
    assert nm == "sim-0" and b - a >= 20 * STEP_S and (batch, attempt) == (spec.batch_id, spec.attempt)


async def test_a_slower_gpu_type_takes_longer_per_step(fleet: Fleet) -> None:
    fleet.run(0, _spec(1, evals=[(1, 20)]))
    fleet.run(1, _spec(2, evals=[(1, 20)]))
    await fleet.report(0, 1)
    await fleet.report(1, 2)
    took = {nm: b - a for nm, _slot, a, b, *_ in fleet.activity.intervals}
    assert took["sim-1"] >= 3 * took["sim-0"] * 0.9  # speed 0.25 against 1


async def test_a_resumed_batch_does_not_save_its_source_again(fleet: Fleet) -> None:
    source = Source(Point(1, 5), "sim://x/n1/s5")
    spec = digits_batch([(1, 5, 20, HP)], batch_id=3, saves=[(1, 5), (1, 20)], source=source)
    fleet.run(0, spec)
    report = await fleet.report(0, 3)
    assert [(c.node, c.step) for c in report.checkpoints] == [(1, 20)]  # type: ignore[attr-defined]


async def test_preempt_ends_at_the_step_reached_with_a_peripheral_checkpoint(fleet: Fleet) -> None:
    fleet.run(0, _spec(4, steps=1000, saves=[(1, 1000)]))
    await asyncio.sleep(30 * STEP_S)
    fleet.links[0].feed.put_nowait(Assignment(4, 1, PREEMPT))
    report = await fleet.report(0, 4)
    assert report.preempted  # type: ignore[attr-defined]
    [ckpt] = report.checkpoints  # type: ignore[attr-defined]
    assert 1 <= ckpt.step < 1000 and ckpt.uri.startswith("sim://")


async def test_abort_ends_the_attempt_without_a_result(fleet: Fleet) -> None:
    fleet.run(1, _spec(5, steps=1000, evals=[(1, 1000)]))
    await asyncio.sleep(5 * STEP_S)
    fleet.links[1].feed.put_nowait(Assignment(5, 1, ABORT))
    report = await fleet.report(1, 5)
    assert not report.ok and not report.metrics  # type: ignore[attr-defined]


def test_gpu_types_parse_and_bad_ones_are_named() -> None:
    assert sim.GpuType.parse_list("A100:1, V100:0.5,T4") == (
        sim.GpuType("A100", 1.0),
        sim.GpuType("V100", 0.5),
        sim.GpuType("T4", 1.0),
    )
    for bad in ("", "A100:fast", "A100:0", ":1"):
        with pytest.raises(InvalidArgument):
            sim.GpuType.parse_list(bad)
