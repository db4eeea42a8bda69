"""Simulated node managers: the real ``NodeManager`` with workers that take time but do no math.

One process can play hundreds of GPU servers against a real master: each ``NodeManager`` registers,
heartbeats, consumes its assignment stream and reports through the real link and reporter (gRPC, or
Kafka for the aggregators), exactly as a real one does. Only the worker is simulated: a
``SimulatedWorker`` is an asyncio task that emits the runtime's events (``runtime.events``) at the times
a real worker would, given a time per step for its slot's GPU type: ``batch_started``, ``metrics`` where
requests wait (a synthetic loss curve, deterministic per configuration and step, so tuners can rank
trials), ``checkpoint_saved`` at the batch's saves (``sim://`` URIs, nothing written), then
``batch_finished``. A PREEMPT (SIGUSR1) ends it at the step it has reached with a peripheral checkpoint,
an ABORT (kill) ends it at once with no terminal event, as a killed process would.

``stagetree nodemanager simulate`` runs a fleet of them (``run_fleet``); ``tests.bench.scale`` drives one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagetree.core.batch import BatchSpec, Point, StageSpec
from stagetree.core.errors import InvalidArgument
from stagetree.core.simulator import synthetic_curve
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.agent import NodeManager
from stagetree.nodemanager.link import MasterLink
from stagetree.nodemanager.reporting import BatchReporter
from stagetree.nodemanager.runtime.checkpoints import CheckpointStore, StoredCheckpoint
from stagetree.nodemanager.runtime.events import encode_event
from stagetree.nodemanager.workers import WorkerLauncher, WorkerProcess

log = logging.getLogger(__name__)

SIM_SCHEME = "sim://"
GiB = 1 << 30


@dataclass(frozen=True)
class GpuType:
    """A simulated GPU model: its name (what the master's estimator keys costs by) and its speed
    relative to the reference (a step takes ``step_s / speed``)."""

    name: str
    speed: float = 1.0
    memory_bytes: int = 80 * GiB

    @classmethod
    def parse_list(cls, text: str) -> tuple[GpuType, ...]:
        """``"A100:1.0,V100:0.5"`` → two types; a name without ``:speed`` has speed 1."""
        out = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            name, _, speed = part.partition(":")
            try:
                s = float(speed) if speed else 1.0
            except ValueError:
                raise InvalidArgument(f"GPU type {part!r}: the speed after ':' must be a number") from None
            if not name or not s > 0:
                raise InvalidArgument(f"GPU type {part!r}: needs a name and a speed > 0, e.g. A100:1.0")
            out.append(cls(name, s))
        if not out:
            raise InvalidArgument("no GPU type given (e.g. A100:1.0,V100:0.5)")
        return tuple(out)


@dataclass(frozen=True)
class SimulationModel:
    """How simulated batches behave: ``step_s`` seconds per step on a speed-1 GPU, ``eval_s`` per
    evaluation, ``load_s`` to load a source checkpoint, the bytes a checkpoint claims, and the seed of
    the synthetic learning curves."""

    step_s: float = 0.1
    eval_s: float = 0.0
    load_s: float = 0.0
    checkpoint_bytes: int = 100 << 20
    curve_seed: int = 0


@dataclass
class SlotActivity:
    """When each slot was busy, for occupancy figures: (node manager, slot id, start, end, batch id,
    attempt), the times in ``time.time()`` seconds."""

    intervals: list[tuple[str, str, float, float, int, int]] = field(default_factory=list)


class SimulatedCheckpointStore(CheckpointStore):
    """Checkpoints that exist only as names: ``put`` writes nothing, ``delete`` forgets."""

    def __init__(self, node_manager_id: str, checkpoint_bytes: int) -> None:
        self.node_manager_id = node_manager_id
        self.checkpoint_bytes = checkpoint_bytes
        self.held: set[str] = set()

    @property
    def location(self) -> str:
        return f"{SIM_SCHEME}{self.node_manager_id}"

    def uri(self, key: str) -> str:
        return f"{self.location}/{key}"

    def put(self, key: str, write: Callable[[Path], None]) -> StoredCheckpoint:
        uri = self.uri(key)
        self.held.add(uri)
        return StoredCheckpoint(uri, self.checkpoint_bytes)

    @contextlib.contextmanager
    def open(self, uri: str) -> Iterator[Path]:
        raise InvalidArgument("a simulated checkpoint has no contents")
        yield Path()  # pragma: no cover  (makes this a generator)

    def exists(self, uri: str) -> bool:
        return uri.startswith(SIM_SCHEME)

    def delete(self, uri: str) -> None:
        self.held.discard(uri)


_pids = itertools.count(1 << 30)  # fake, never signalled: well above any real pid


class SimulatedWorker(WorkerProcess):
    """A batch attempt played by a task: the events a real worker emits, at the times it would."""

    def __init__(
        self,
        spec: BatchSpec,
        slot: SlotInfo,
        speed: float,
        model: SimulationModel,
        store: SimulatedCheckpointStore,
        activity: SlotActivity | None,
    ) -> None:
        reader = asyncio.StreamReader()
        super().__init__(slot, Path("/dev/null"), reader, None)
        self._reader = reader
        self._spec = spec
        self._step_s = model.step_s / speed
        self._model = model
        self._store = store
        self._activity = activity
        self._curve = synthetic_curve(model.curve_seed)
        self._pid = next(_pids)
        self._rc: int | None = None
        self._preempt = asyncio.Event()
        self._exited = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-b{spec.batch_id}")

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._rc

    async def wait(self) -> int:
        await self._exited.wait()
        assert self._rc is not None
        return self._rc

    def send_signal(self, sig: int) -> None:
        if self._rc is None and sig == signal.SIGUSR1:
            self._preempt.set()
        elif self._rc is None and sig in (signal.SIGKILL, signal.SIGTERM):
            self.kill()

    def kill(self) -> None:
        if self._rc is None:
            self.killed = True
            self._task.cancel()

    def kill_session(self) -> None:
        self.kill()

    def stderr_tail(self, max_bytes: int = 4000) -> str:
        return ""

    # -- the simulated batch --------------------------------------------------------------------

    def _emit(self, kind: str, payload: dict[str, Any]) -> None:
        self._reader.feed_data(encode_event(kind, payload).encode())

    async def _sleep_or_preempt(self, seconds: float) -> bool:
        """Sleep ``seconds``; True if a preemption came first."""
        if seconds <= 0:
            return self._preempt.is_set()
        try:
            await asyncio.wait_for(self._preempt.wait(), timeout=seconds)
        except TimeoutError:
            return False
        return True

    async def _run(self) -> None:
        spec = self._spec
        ids = {"batch_id": spec.batch_id, "attempt": spec.attempt}
        started = time.time()
        rc = -signal.SIGKILL
        try:
            self._emit("batch_started", ids)
            if spec.source.uri is not None and self._model.load_s > 0:
                await asyncio.sleep(self._model.load_s)
            points = sorted(spec.saves | spec.evals, key=lambda p: p.step)
            handled: set[Point] = set()
            if spec.source.point in points:
                await self._points(spec.stages[0], spec.source.point, ids, handled)
            trained = 0
            for stage in spec.stages:
                here = [p for p in points if p.node == stage.node and stage.start <= p.step < stage.end]
                at = stage.start
                for p in [*here, Point(stage.node, stage.end)]:
                    t0 = time.monotonic()
                    if p.step > at and await self._sleep_or_preempt((p.step - at) * self._step_s):
                        done = min(p.step - 1, at + int((time.monotonic() - t0) / self._step_s))
                        trained += done - at
                        self._end_preempted(Point(stage.node, done), ids)
                        rc = 0
                        return
                    trained += p.step - at
                    at = p.step
                    await self._points(stage, p, ids, handled)
            self._emit("batch_finished", {**ids, "steps": trained})
            rc = 0
        except asyncio.CancelledError:
            rc = -signal.SIGKILL  # an ABORT: killed without a terminal event
        finally:
            self._rc = rc
            if self._activity is not None:
                self._activity.intervals.append(
                    (self._store.node_manager_id, self.slot.id, started, time.time(), spec.batch_id, spec.attempt)
                )
            self._reader.feed_eof()
            self._exited.set()

    async def _points(self, stage: StageSpec, p: Point, ids: dict[str, int], handled: set[Point]) -> None:
        """Evaluate and save at ``p`` as the batch asks (once per point)."""
        spec = self._spec
        if p in handled:
            return
        handled.add(p)
        if p in spec.evals:
            if self._model.eval_s > 0:
                await asyncio.sleep(self._model.eval_s)
            loss = self._curve(stage.config, p.step)
            self._emit("metrics", {**ids, "node": p.node, "step": p.step, "metrics": {"loss": loss}})
        if p in spec.saves and not (p == spec.source.point and spec.source.uri is not None):
            self._checkpoint(p, "central", ids)

    def _checkpoint(self, p: Point, kind: str, ids: dict[str, int]) -> str:
        spec = self._spec
        stored = self._store.put(f"n{p.node}/s{p.step}-{kind}-b{spec.batch_id}a{spec.attempt}", lambda _d: None)
        payload = {**ids, "node": p.node, "step": p.step, "uri": stored.uri, "bytes": stored.bytes, "kind": kind}
        payload["ranks"] = spec.slots
        self._emit("checkpoint_saved", payload)
        return stored.uri

    def _end_preempted(self, p: Point, ids: dict[str, int]) -> None:
        uri = self._checkpoint(p, "peripheral", ids)
        self._emit("batch_preempted", {**ids, "node": p.node, "step": p.step, "uri": uri, "ranks": self._spec.slots})


class SimulatedLauncher(WorkerLauncher):
    """Starts ``SimulatedWorker`` tasks instead of processes; a slot's GPU type sets its speed."""

    def __init__(
        self,
        speeds: dict[str, float],
        model: SimulationModel,
        store: SimulatedCheckpointStore,
        activity: SlotActivity | None = None,
    ) -> None:
        super().__init__("", Path("/nonexistent"), prestart=False, prepare=False)
        self._speeds = speeds
        self._model = model
        self._store = store
        self._activity = activity

    async def _start(self, slot: SlotInfo) -> WorkerProcess:  # pragma: no cover  (spawn does it all)
        raise OSError("simulated workers start with their batch")

    async def start(self, slots: Sequence[SlotInfo]) -> None:
        return None

    async def spawn(self, spec: BatchSpec, slot: SlotInfo) -> WorkerProcess:
        return SimulatedWorker(
            spec, slot, self._speeds.get(slot.gpu_type, 1.0), self._model, self._store, self._activity
        )

    async def close(self) -> None:
        return None


def simulated_slots(node_index: int, gpus: int, gpu_type: GpuType) -> list[SlotInfo]:
    """``gpus`` whole-GPU slots of one type, as NVML would describe them."""
    return [
        SlotInfo(
            id=f"gpu{i}",
            gpu_type=gpu_type.name,
            memory_bytes=gpu_type.memory_bytes,
            compute_capability="8.0",
            gpu_index=i,
            cpu_cores=8,
        )
        for i in range(gpus)
    ]


@dataclass(frozen=True)
class FleetSpec:
    """A fleet: ``count`` node managers named ``{prefix}-{i}`` with ``gpus`` slots each, their GPU types
    assigned round-robin from ``gpu_types``."""

    count: int
    gpus: int = 8
    gpu_types: tuple[GpuType, ...] = (GpuType("A100", 1.0),)
    prefix: str = "sim"
    model: SimulationModel = SimulationModel()
    heartbeat_interval_s: float | None = None


def build_fleet(
    spec: FleetSpec,
    make_link: Callable[[], MasterLink],
    make_reporter: Callable[[MasterLink, str], BatchReporter],
    activity: SlotActivity | None = None,
) -> list[NodeManager]:
    """The fleet's node managers, each with its own link and reporter (built by the callables), not started."""
    if spec.count < 1 or spec.gpus < 1:
        raise InvalidArgument("a fleet needs at least one node manager with at least one GPU")
    speeds = {t.name: t.speed for t in spec.gpu_types}
    fleet = []
    for i in range(spec.count):
        nm_id = f"{spec.prefix}-{i}"
        gpu_type = spec.gpu_types[i % len(spec.gpu_types)]
        store = SimulatedCheckpointStore(nm_id, spec.model.checkpoint_bytes)
        link = make_link()
        fleet.append(
            NodeManager(
                link,
                make_reporter(link, nm_id),
                simulated_slots(i, spec.gpus, gpu_type),
                SimulatedLauncher(speeds, spec.model, store, activity),
                node_manager_id=nm_id,
                address=f"{nm_id}.simulated",
                store=store,
                heartbeat_interval_s=spec.heartbeat_interval_s,
                stop_grace_s=5.0,
            )
        )
    return fleet


async def run_fleet(
    fleet: Sequence[NodeManager],
    stop: asyncio.Event,
    activity_out: Path | None = None,
    activity: SlotActivity | None = None,
) -> None:
    """Run every node manager of ``fleet`` until ``stop``; then write the slots' busy intervals (JSON
    lines ``[node_manager, slot, start, end, batch_id, attempt]``) to ``activity_out`` when given."""
    tasks = [asyncio.create_task(nm.run(stop), name=f"nm-{nm.id}") for nm in fleet]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for nm, r in zip(fleet, results, strict=True):
            if isinstance(r, BaseException):
                log.error("simulated node manager ended with an error: %r", r, extra={"node_manager_id": nm.id})
    finally:
        if activity_out is not None and activity is not None:
            with open(activity_out, "w") as f:
                for interval in activity.intervals:
                    f.write(json.dumps(list(interval)) + "\n")
