"""Composition root of the master: builds every part once from ``MasterSettings`` and runs them.

Nothing here runs at import time; ``MasterApp.build`` connects (and refuses an old schema),
``MasterApp.run`` serves gRPC and REST (TLS with ``settings.tls``; plaintext beyond loopback is warned
about, loudly) and runs the scheduling loop until stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from stagetree.core.lifecycle import RetryPolicy
from stagetree.master import metrics
from stagetree.master.api.admission import Admission
from stagetree.master.api.grpc_api import MasterGrpc, start_grpc_server
from stagetree.master.auth import Authenticator, team_of
from stagetree.master.checkpoint_files import checkpoint_files
from stagetree.master.coordination import Coordination, InProcessCoordination, RedisCoordination
from stagetree.master.plans import PlanCache
from stagetree.master.scheduling import SchedulingLoop
from stagetree.master.service import MasterService
from stagetree.master.settings import MasterSettings
from stagetree.master.store.store import Store, make_engine
from stagetree.tls import is_loopback

log = logging.getLogger(__name__)


@dataclass
class MasterApp:
    settings: MasterSettings
    store: Store
    coordination: Coordination
    auth: Authenticator
    service: MasterService
    scheduler: SchedulingLoop
    admission: Admission
    # the latest GPU samples, for the dashboard's cluster page: what the aggregators wrote to the database
    # (cluster mode); the embedded mode reads its aggregator's memory instead
    telemetry: Callable[[], Sequence[Mapping[str, Any]]] | None = None
    # the worker logs of a batch attempt, ``(node manager, batch, attempt) -> files``, where this master can
    # read them (the embedded mode: its node manager's work directory is on this host); None in cluster
    # mode, where a log stays on its node manager's host and the dashboard says where
    worker_logs: Callable[[str, int, int], Sequence[Path]] | None = None

    @classmethod
    def build(cls, settings: MasterSettings, coordination: Coordination | None = None) -> MasterApp:
        store = Store.open(
            make_engine(settings.database_url, pool_size=max(10, (settings.api_threads or 0) // 2))
        )  # raises FailedPrecondition on an old schema
        if coordination is None:
            coordination = RedisCoordination(settings.redis_url) if settings.redis_url else InProcessCoordination()
        plans = PlanCache(store.plans)
        service = MasterService(store, settings.limits, coordination, plans)
        service.retry = RetryPolicy(settings.scheduling.max_attempts)
        service.assignment_grace_s = settings.scheduling.heartbeat_ttl_s
        service.teams = team_of(settings.auth)
        instance = settings.instance_id or f"{socket.gethostname()}:{os.getpid()}"
        files = checkpoint_files(settings.s3_endpoint_url)
        scheduler = SchedulingLoop(store, plans, coordination, settings.scheduling, instance, files)
        metrics.track(store)
        admission = Admission(settings.limits.max_in_flight, settings.limits.retry_after_s)
        app = cls(settings, store, coordination, Authenticator(settings.auth), service, scheduler, admission)
        app.telemetry = store.telemetry.latest
        return app

    def grpc_servicer(self) -> MasterGrpc:
        return MasterGrpc(
            self.service,
            self.auth,
            self.coordination,
            self.settings.scheduling.heartbeat_ttl_s / 3,
            self.admission,
        )

    async def start_grpc(self, port: int | None = None) -> tuple[grpc.aio.Server, int]:
        s = self.settings
        creds = s.tls.grpc_credentials() if s.tls.enabled else None
        return await start_grpc_server(self.grpc_servicer(), s.grpc_host, s.grpc_port if port is None else port, creds)

    def warn_if_exposed(self) -> list[str]:
        """Log, loudly, each listener beyond loopback that serves plaintext; returns those warnings."""
        s = self.settings
        if s.tls.enabled:
            return []
        out = []
        for what, host, port in (("gRPC", s.grpc_host, s.grpc_port), ("REST", s.http_host, s.http_port)):
            if not is_loopback(host):
                msg = (
                    f"PLAINTEXT {what} on {host}:{port}: bearer tokens and results cross the network "
                    "unencrypted; set STAGETREE_MASTER_TLS__CERT_FILE and STAGETREE_MASTER_TLS__KEY_FILE "
                    "(docs/deployment.md), or bind to 127.0.0.1"
                )
                log.warning("!" * 20 + " " + msg + " " + "!" * 20)
                out.append(msg)
        return out

    async def run(self, stop: asyncio.Event) -> None:
        import uvicorn

        from stagetree.master.api.rest import create_rest_app

        self.warn_if_exposed()
        if self.settings.api_threads is not None:
            asyncio.get_running_loop().set_default_executor(
                ThreadPoolExecutor(max_workers=self.settings.api_threads, thread_name_prefix="api")
            )
        server, port = await self.start_grpc()
        http = uvicorn.Server(
            uvicorn.Config(
                create_rest_app(self),
                host=self.settings.http_host,
                port=self.settings.http_port,
                **self.settings.tls.uvicorn_options(),
            )
        )
        http_task = asyncio.create_task(http.serve())
        log.info("master running", extra={"grpc_port": port, "http_port": self.settings.http_port})
        try:
            await self.scheduler.run(stop)
        finally:
            http.should_exit = True
            await http_task
            await server.stop(grace=2)
            self.close()

    def close(self) -> None:
        self.coordination.close()
        self.store.dispose()
