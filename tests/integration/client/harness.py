"""A platform to run the SDK against: an in-process master plus a no-op node manager.

``NoopNodeManager`` trains nothing but speaks the real node-manager RPCs (``RegisterNodeManager`` with a
few slots, ``Heartbeat``, ``StreamAssignments``, ``ReportBatch``): for each batch it reports metrics at
every eval point, computed by ``noop_metrics`` (a cheap deterministic function of the config's values
and the step), and a checkpoint at every save point. So only the platform is measured, and each
batch it ran is recorded (``batches``, ``trained_steps``) for tests that check what was shared.

``in_process_master(settings)`` starts the master the way the embedded mode will (gRPC on a free port,
the scheduling loop, optionally the REST API under uvicorn) with a no-op node manager, and yields a
``Platform``. Swapping in the real embedded mode is replacing that one call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from stagetree.core.batch import BatchSpec, Point
from stagetree.core.config import Config
from stagetree.master.app import MasterApp
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.settings import MasterSettings
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Metrics = Callable[[Config, int], dict[str, float]]
RETRIABLE = (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
REPORT_RETRY_S = 60.0


def metrics_of_values(values: Mapping[str, Any], step: int) -> dict[str, float]:
    """``acc`` rises with the step and peaks where the product of the numeric hyper-parameter values is
    0.03; ``loss`` is ``1 - acc``. Cheap and deterministic."""
    x = 1.0
    for v in values.values():
        if isinstance(v, int | float) and not isinstance(v, bool):
            x *= abs(float(v)) + 1e-12
    fit = 1.0 / (1.0 + (math.log10(x) - math.log10(0.03)) ** 2)
    acc = round((1.0 - math.exp(-step / 10.0)) * fit, 6)
    return {"acc": acc, "loss": round(1.0 - acc, 6)}


def noop_metrics(config: Config, step: int) -> dict[str, float]:
    """The metrics after ``step`` steps of ``config``: a function of the values in force at the last step
    trained, so it depends on nothing a shared prefix does not fix."""
    return metrics_of_values(config.values_at(max(step - 1, 0)), step)


def _config_at(spec: BatchSpec, p: Point) -> Config:
    for s in spec.stages:
        if s.node == p.node and s.start <= p.step <= s.end:
            return s.config
    for s in spec.stages:
        if s.node == p.node:
            return s.config
    return spec.stages[-1].config


@dataclass
class NoopNodeManager:
    target: str
    admin_token: str
    slots: int = 4
    metrics: Metrics = noop_metrics
    fail_if: Callable[[Config], str | None] = lambda _config: None  # an error message fails the batch
    node_manager_id: str = field(default_factory=lambda: f"noop-{uuid.uuid4().hex[:8]}")
    batches: list[BatchSpec] = field(default_factory=list)
    trained_steps: int = 0
    reports: int = 0

    def __post_init__(self) -> None:
        self._md = (("authorization", f"Bearer {self.admin_token}"),)
        self._tasks: set[asyncio.Task[None]] = set()
        self._channel: grpc.aio.Channel | None = None
        self._gate = asyncio.Event()
        self._gate.set()

    def pause(self) -> None:
        """Hold every batch (received or not) until ``resume``: its requests stay SCHED."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    async def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.target)
        self.stub = pb_grpc.MasterServiceStub(self._channel)
        resp = await self.stub.RegisterNodeManager(
            pb.RegisterNodeManagerRequest(
                node_manager_id=self.node_manager_id,
                address="noop",
                slots=[pb.Slot(id=f"s{i}", gpu_type="cpu", gpu_index=-1) for i in range(self.slots)],
            ),
            metadata=self._md,
        )
        # The master records the liveness key only after registering, and registering already woke a
        # round that may have found no key and marked this node manager lost: a heartbeat revives it.
        await self.stub.Heartbeat(pb.HeartbeatRequest(node_manager_id=self.node_manager_id), metadata=self._md)
        self._spawn(self._heartbeats(max(resp.heartbeat_interval_s, 0.1)))
        self._spawn(self._assignments())

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _heartbeats(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(grpc.RpcError):
                await self.stub.Heartbeat(pb.HeartbeatRequest(node_manager_id=self.node_manager_id), metadata=self._md)

    async def _assignments(self) -> None:
        while True:
            try:
                call = self.stub.StreamAssignments(
                    pb.StreamAssignmentsRequest(node_manager_id=self.node_manager_id), metadata=self._md
                )
                async for a in call:
                    if a.kind == pb.RUN:
                        self._spawn(self._run(a))
                    # ABORT / PREEMPT: a no-op batch is over before either could matter; its stale report is ignored
            except grpc.RpcError as exc:
                log.info("assignment stream broke (%s); reopening", exc.code())
                await asyncio.sleep(0.05)

    async def _run(self, a: pb.Assignment) -> None:
        spec = BatchSpec.from_json(json.loads(a.batch_spec_json))
        await self._gate.wait()
        self.batches.append(spec)
        self.trained_steps += spec.steps
        metrics = [
            pb.MetricPoint(node=p.node, step=p.step, values=self.metrics(_config_at(spec, p), p.step))
            for p in sorted(spec.evals)
        ]
        ckpts = [
            pb.CheckpointPoint(
                node=p.node,
                step=p.step,
                uri=f"noop://{spec.plan_key}/{p.node}/{p.step}",
                bytes=CHECKPOINT_BYTES,
                kind="central",
            )
            for p in sorted(spec.saves)
        ]
        errors = [e for e in (self.fail_if(st.config) for st in spec.stages) if e]
        if errors:
            req = pb.ReportBatchRequest(batch_id=a.batch_id, attempt=a.attempt, ok=False, error=errors[0])
        else:
            req = pb.ReportBatchRequest(
                batch_id=a.batch_id, attempt=a.attempt, ok=True, metrics=metrics, checkpoints=ckpts
            )
        deadline = time.monotonic() + REPORT_RETRY_S
        delay = 0.02
        while True:  # a report is idempotent: keep resending it while the master says a retry can help
            try:
                await self.stub.ReportBatch(req, metadata=self._md)
                self.reports += 1
                return
            except grpc.RpcError as exc:
                if exc.code() not in RETRIABLE or time.monotonic() > deadline:
                    log.error("ReportBatch of batch %d failed for good: %s", a.batch_id, exc.code())
                    return
                log.info("ReportBatch of batch %d: %s; retrying", a.batch_id, exc.code())
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)


@dataclass
class Platform:
    """What a test or the bench needs to talk to a running platform."""

    grpc_target: str
    http_url: str | None
    admin_token: str
    node_manager: NoopNodeManager
    app: MasterApp | None = None


CHECKPOINT_BYTES = 4096  # what each no-op checkpoint claims to hold


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def in_process_master(settings: MasterSettings, *, slots: int = 4, http: bool = False) -> AsyncIterator[Platform]:
    """A master on ``settings`` (gRPC on a free port, its scheduling loop, REST when ``http``) and a no-op
    node manager with ``slots`` slots, in this event loop; everything is stopped on exit."""
    app = MasterApp.build(settings, coordination=InProcessCoordination())
    server, port = await app.start_grpc(port=0)
    stop = asyncio.Event()
    scheduler = asyncio.create_task(app.scheduler.run(stop))
    uv = thread = None
    http_url = None
    nm = NoopNodeManager(f"127.0.0.1:{port}", settings.auth.admin_token.get_secret_value(), slots=slots)
    try:
        if http:
            import uvicorn

            from stagetree.master.api.rest import create_rest_app

            hport = free_port()
            uv = uvicorn.Server(uvicorn.Config(create_rest_app(app), host="127.0.0.1", port=hport, log_level="warning"))
            thread = threading.Thread(target=uv.run, daemon=True)
            thread.start()
            deadline = time.monotonic() + 10
            while not uv.started:
                if time.monotonic() > deadline:
                    raise RuntimeError("uvicorn did not start in 10 s")
                await asyncio.sleep(0.02)
            http_url = f"http://127.0.0.1:{hport}"
        await nm.start()
        yield Platform(f"127.0.0.1:{port}", http_url, nm.admin_token, nm, app)
    finally:
        await nm.stop()
        stop.set()
        deadline = time.monotonic() + 10
        while not scheduler.done() and time.monotonic() < deadline:
            app.coordination.notify("round")  # a wake-up is a hint: one sent mid-round is lost, so repeat it
            await asyncio.wait({scheduler}, timeout=0.05)
        if not scheduler.done():
            scheduler.cancel()
        with contextlib.suppress(BaseException):
            await scheduler
        if uv is not None and thread is not None:
            uv.should_exit = True
            await asyncio.to_thread(thread.join, 10)
        await server.stop(grace=None)
        app.close()
