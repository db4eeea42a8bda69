"""Embedded mode: master, aggregator and one node manager in this process, with no servers to install.

The same components as the cluster, wired with in-process adapters (ARCHITECTURE §8): SQLite in place
of Postgres, :class:`~stagetree.bus.inprocess.InProcessBus` in place of Kafka and in-process
coordination in place of Redis. The node manager still runs the batches in worker processes on the
local GPUs (or CPU slots), warm ones that run batch after batch, and reports through the bus; the
aggregator applies the bus to the database in its own thread. ``start`` returns once the node manager
has registered: the fork server, which imports torch, starts first and beside the rest of the start-up,
and a first batch waits for the workers (``workers_ready``) rather than the start for them. Clients talk
gRPC to it exactly as to a cluster's master::

    async with Embedded(EmbeddedSettings(workers=2)) as cluster:
        async with stagetree.connect(cluster.target, token=cluster.token) as client:
            ...

``stagetree up`` runs it in the foreground until Ctrl-C and prints the address and token. One master per
home: a second ``Embedded`` or ``stagetree up`` on a home in use is refused, naming the process that uses
it (``stagetree.homelock``).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import gc
import logging
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TextIO

from stagetree import logs
from stagetree.core.errors import FailedPrecondition
from stagetree.gcpause import gc_paused
from stagetree.homelock import HomeLock

log = logging.getLogger(__name__)

EMBEDDED_OWNER = "local"


@dataclass
class EmbeddedSettings:
    """What the embedded mode needs; every field has a default that works on a laptop."""

    home: Path = field(default_factory=lambda: Path(".stagetree"))  # database, checkpoints, worker logs
    workers: int = 2  # CPU worker slots when there is no GPU
    slots_per_gpu: int = 1
    mps: bool = False  # run each GPU's slots under an MPS daemon (HyperSack's packing, with slots_per_gpu > 1)
    threads_per_worker: int = 1
    grpc_port: int = 0  # 0: a free port
    http_port: int | None = None  # None: no REST server
    token: str = ""  # the owner token clients use; "" makes a random one
    admin_token: str = ""
    policy: str = "critical_path"
    step_seconds: float = 0.05  # the cost model's cold-start guess of one training step
    prestart_workers: bool = True
    database_url: str = ""  # "" -> SQLite under home
    node_manager_id: str = "embedded"
    # learning curves: a point every this many steps, at most this many a second per batch (0: no limit)
    curve_every_steps: int = 1
    curve_max_per_s: float = 20.0
    # where workers import the user's trainer from: the running script's directory and the working directory
    user_path: tuple[str, ...] = field(default_factory=lambda: script_paths())
    # say what the start does and waits for: None where a person watches (a terminal or a notebook)
    progress: bool | None = None
    # modules the workers import before their first batch (in the fork server: once), besides the
    # trainer module of the studies' work, which the node manager preloads with no setting, and
    # STAGETREE_NM_WORKER_PRELOAD's; e.g. ("sklearn", "pandas") when the trainer imports them
    worker_preload: tuple[str, ...] = ()
    worker_reuse: bool = True  # a worker runs batch after batch (docs/trainers.md, "warm workers")
    # the fork server is a fork of this process, taken at start where that is safe (one thread, no gRPC
    # or CUDA running yet): it then holds what the script imported, torch and the trainer's modules
    fork_workers_from_script: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home))  # a str is fine too

    def resolved(self) -> EmbeddedSettings:
        home = self.home.resolve()
        return EmbeddedSettings(
            home=home,
            workers=self.workers,
            slots_per_gpu=self.slots_per_gpu,
            mps=self.mps,
            threads_per_worker=self.threads_per_worker,
            grpc_port=self.grpc_port,
            http_port=self.http_port,
            token=self.token or secrets.token_urlsafe(16),
            admin_token=self.admin_token or secrets.token_urlsafe(16),
            policy=self.policy,
            step_seconds=self.step_seconds,
            prestart_workers=self.prestart_workers,
            database_url=self.database_url or f"sqlite:///{home / 'stagetree.db'}",
            node_manager_id=self.node_manager_id,
            curve_every_steps=self.curve_every_steps,
            curve_max_per_s=self.curve_max_per_s,
            user_path=self.user_path,
            progress=self.progress,
            worker_preload=self.worker_preload,
            worker_reuse=self.worker_reuse,
            fork_workers_from_script=self.fork_workers_from_script,
        )


def freeze_at_exit() -> None:
    """Have this process's interpreter skip the cyclic collector over what is alive at exit: with torch,
    the trainer's modules and the master imported, an interpreter's teardown spent about a second of CPU
    (measured on ``tests/bench/userstyle``'s modules) freeing memory the process is about to give back.
    The script's semantics are untouched until then (``gc.freeze`` runs in an ``atexit`` handler, after
    the script's own); registered once however often it is called."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def script_paths() -> tuple[str, ...]:
    """The directories this process imports the user's modules from that a worker process would not:
    the running script's (``sys.path[0]``) and the working directory."""
    out = []
    first = sys.path[0] if sys.path else ""
    for p in (first, os.getcwd()):
        p = os.path.abspath(p) if p else os.getcwd()
        if os.path.isdir(p) and p not in out:
            out.append(p)
    return tuple(out)


class Embedded:
    """A running embedded cluster; use as an async context manager (or ``start``/``stop``)."""

    def __init__(self, settings: EmbeddedSettings | None = None) -> None:
        self.settings = (settings or EmbeddedSettings()).resolved()
        self.target = ""
        self.http_url = ""
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._server: Any = None
        self._http: Any = None
        self.app: Any = None
        self.aggregator: Any = None
        self.node_manager: Any = None
        self.bus: Any = None
        self._home_lock: HomeLock | None = None
        self.worker_fork = "none"  # where the workers' fork server came from: "script", "fresh" or "none"

    @property
    def token(self) -> str:
        return self.settings.token

    @property
    def admin_token(self) -> str:
        return self.settings.admin_token

    async def start(self) -> Self:
        """Start the master, the aggregator and the node manager; returns once the node manager has
        registered its slots. The cyclic collector is paused meanwhile (``gcpause``): the start imports
        the master's modules into a process that holds torch and the user's, and the full collections
        those imports would trigger cost a script some 0.3 s of CPU."""
        with gc_paused():
            return await self._start()

    async def _start(self) -> Self:
        from pydantic import SecretStr

        from stagetree.aggregator.aggregator import Aggregator
        from stagetree.bus.inprocess import InProcessBus
        from stagetree.master.app import MasterApp
        from stagetree.master.coordination import InProcessCoordination
        from stagetree.master.settings import AuthSettings, MasterSettings, SchedulingSettings
        from stagetree.master.store.ingest import Ingestor
        from stagetree.master.store.schema import upgrade
        from stagetree.master.store.store import make_engine
        from stagetree.nodemanager.app import build_node_manager
        from stagetree.nodemanager.runtime.userpath import trainer_import_problem
        from stagetree.nodemanager.settings import NodeManagerSettings
        from stagetree.nodemanager.workers import ensure_fork_server, fork_this_process

        s = self.settings
        t0 = time.monotonic()
        freeze_at_exit()
        slots = f"{s.workers} CPU worker slots unless it finds GPUs"
        self._say(f"starting an embedded stagetree in {s.home} (a master and a node manager with {slots}) ...")
        nm_settings = NodeManagerSettings(
            admin_token=SecretStr(s.admin_token),
            node_manager_id=s.node_manager_id,
            address="embedded",
            checkpoint_root=str(s.home / "checkpoints"),
            work_dir=str(s.home / "work"),
            slots_per_gpu=s.slots_per_gpu,
            mps=s.mps,
            cpu_slots=s.workers,
            threads_per_worker=s.threads_per_worker,
            prestart_workers=s.prestart_workers,
            progress_interval_s=0.5,
            user_path=os.pathsep.join(s.user_path),
            worker_reuse=s.worker_reuse,
        )
        if s.worker_preload:
            extra = ",".join([nm_settings.worker_preload, *s.worker_preload])
            nm_settings = nm_settings.model_copy(update={"worker_preload": extra})
        if nm_settings.worker_start != "exec":
            preload = [m.strip() for m in nm_settings.worker_preload.split(",")]
            if s.fork_workers_from_script:
                # While this process is one thread (before the home's lock, threads, gRPC): a fork of it as
                # the workers' fork server holds what the script imported (torch, the trainer's modules),
                # which no worker then imports again.
                why_not = fork_this_process(preload)
                self.worker_fork = "script" if why_not is None else "fresh"
                if why_not:
                    log.info("the workers' fork server is a fresh interpreter (forking this process: %s)", why_not)
            # The fork server imports torch (seconds of CPU): started first, it does so beside this
            # process's own start-up instead of after it, and the node manager's launcher finds it up.
            self._tasks.append(asyncio.create_task(asyncio.to_thread(ensure_fork_server, preload)))
        self._home_lock = HomeLock.acquire(s.home)  # one master per home (stagetree.homelock)
        engine = make_engine(s.database_url)
        try:
            upgrade(engine)  # the embedded database is ours: bring it to the current schema
        finally:
            engine.dispose()
        master_settings = MasterSettings(
            database_url=s.database_url,
            redis_url=None,
            grpc_host="127.0.0.1",
            grpc_port=s.grpc_port,
            http_host="127.0.0.1",
            http_port=s.http_port or 0,
            instance_id="embedded",
            auth=AuthSettings(tokens={EMBEDDED_OWNER: SecretStr(s.token)}, admin_token=SecretStr(s.admin_token)),
            scheduling=SchedulingSettings(
                policy=s.policy,
                default_step_seconds=s.step_seconds,
                round_interval_s=1.0,
                lease_ttl_s=3.0,
                curve_every_steps=s.curve_every_steps,
                curve_max_per_s=s.curve_max_per_s,
            ),
        )
        coordination = InProcessCoordination()
        self.app = app = MasterApp.build(master_settings, coordination=coordination)
        # the workers run here: a trainer they could not import is refused at study creation
        app.service.trainer_check = functools.partial(trainer_import_problem, path=list(s.user_path))
        self._server, port = await app.start_grpc(port=s.grpc_port)
        self.target = f"127.0.0.1:{port}"
        self._home_lock.note(target=self.target)  # a second master on this home is told where this one is
        if s.http_port is not None:
            await self._start_http()
        self._tasks.append(asyncio.create_task(app.scheduler.run(self._stop), name="stagetree-scheduler"))

        self.bus = bus = InProcessBus()
        self.aggregator = Aggregator(
            bus,
            Ingestor(app.store, app.service.plans, max_failures=master_settings.scheduling.max_attempts),
            coordination,
            max_latency_s=0.005,
            poll_timeout_s=0.05,
            name="embedded-aggregator",
        )
        self.aggregator.start()
        aggregator = self.aggregator
        app.telemetry = lambda: [t.to_json() for t in aggregator.telemetry().values()]

        nm_settings = nm_settings.model_copy(update={"master_target": self.target})
        self.node_manager = build_node_manager(nm_settings, bus=bus)
        launcher, nm_id = self.node_manager.launcher, s.node_manager_id
        app.worker_logs = lambda nm, batch, attempt: launcher.batch_logs(batch, attempt) if nm == nm_id else []
        self._tasks.append(asyncio.create_task(self.node_manager.run(self._stop), name="stagetree-node-manager"))
        self._say("waiting for the node manager to register its slots ...")
        # Up once the node manager has registered its slots: a study can be created and its first batch
        # sent while the workers finish starting (the batch waits for them; ``workers_ready``).
        await self._wait_registered()
        self._say(
            f"ready in {time.monotonic() - t0:.1f} s (gRPC {self.target}); the workers finish starting "
            "(they import torch once) beside the first study"
        )
        log.info("embedded stagetree up", extra={"target": self.target, "home": str(s.home)})
        return self

    async def workers_ready(self, timeout_s: float = 120.0) -> None:
        """Until the node manager's workers can start batches at once (the fork server's imports done, a
        worker waiting on each slot): for a caller that times its studies without the start-up."""
        await asyncio.wait_for(self.node_manager.workers_ready(), timeout_s)

    def _say(self, message: str) -> None:
        """One line of the start's progress: on stderr where a person watches, else in the log."""
        from stagetree.client.progress import watching

        show = watching() if self.settings.progress is None else self.settings.progress
        if show:
            print(f"stagetree: {message}", file=sys.stderr, flush=True)
        else:
            log.info(message)

    async def _wait_registered(self, timeout_s: float = 60.0) -> None:
        """Until the node manager has registered its slots (so the first study gets work at once)."""
        from stagetree.core.lifecycle import NodeManagerState

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            for t in self._tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            nms = await asyncio.to_thread(self.app.store.nodes.node_managers)
            if any(n.id == self.settings.node_manager_id and n.state is NodeManagerState.ALIVE for n in nms):
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"the embedded node manager did not register within {timeout_s:.0f} s")

    async def _start_http(self) -> None:
        import uvicorn

        from stagetree.master.api.rest import create_rest_app

        config = uvicorn.Config(
            create_rest_app(self.app), host="127.0.0.1", port=self.settings.http_port or 0, log_level="warning"
        )
        self._http = uvicorn.Server(config)
        self._tasks.append(asyncio.create_task(self._http.serve(), name="stagetree-rest"))
        while not self._http.started:
            await asyncio.sleep(0.02)
        sock = self._http.servers[0].sockets[0]
        self.http_url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        self._stop.set()
        if self.app is not None:
            self.app.coordination.notify("round")
        if self._http is not None:
            self._http.should_exit = True
        for t in self._tasks:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(t, 60)
        if self.aggregator is not None:
            await asyncio.to_thread(self.aggregator.stop, 10.0)
        if self._server is not None:
            await self._server.stop(grace=1)
        if self.bus is not None:
            self.bus.close()
        if self.app is not None:
            self.app.close()
        if self._home_lock is not None:
            self._home_lock.release()
            self._home_lock = None

    async def __aenter__(self) -> Self:
        try:
            return await self.start()
        except BaseException:
            await self.stop()
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


# -- stagetree up -----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stagetree up", description="run master, aggregator and one node manager here (embedded mode)"
    )
    p.add_argument("--home", type=Path, default=Path(".stagetree"), help="database, checkpoints and logs")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: a free one)")
    p.add_argument("--http-port", type=int, default=8080, help="REST port (-1: no REST server)")
    p.add_argument("--workers", type=int, default=2, help="CPU worker slots when there is no GPU")
    p.add_argument("--slots-per-gpu", type=int, default=1, help="slots each GPU is shared by (packing)")
    p.add_argument("--mps", action="store_true", help="packed slots run under an MPS daemon (concurrent kernels)")
    p.add_argument("--token", default="", help="the owner token clients use (default: a random one)")
    p.add_argument("--admin-token", default="", help="the admin token, for `stagetree hosts` (default: a random one)")
    p.add_argument("--status-every", type=float, default=5.0, help="seconds between status lines (0: none)")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logs.configure(ns.log_level)
    if ns.workers < 1 or ns.slots_per_gpu < 1:
        print("error: --workers and --slots-per-gpu must be at least 1", file=sys.stderr)
        return 2
    settings = EmbeddedSettings(
        home=ns.home,
        workers=ns.workers,
        slots_per_gpu=ns.slots_per_gpu,
        mps=ns.mps,
        grpc_port=ns.port,
        http_port=None if ns.http_port < 0 else ns.http_port,
        token=ns.token,
        admin_token=ns.admin_token,
    )

    from stagetree.client.cli import DEFAULT_URL, ENV_URL

    async def run() -> None:
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, done.set)
        async with Embedded(settings) as cluster:
            print(f"stagetree embedded: gRPC {cluster.target}", flush=True)
            if cluster.http_url:
                print(f"  REST   {cluster.http_url}/api/v1   docs {cluster.http_url}/api/v1/docs", flush=True)
                if cluster.http_url != DEFAULT_URL:  # the CLI and the docs' scripts read it from there
                    print(f"         (export {ENV_URL}={cluster.http_url})", flush=True)
                print(f"  dashboard  {cluster.http_url}/dashboard/#token={cluster.token}   (signs you in)", flush=True)
            print(f"  token  {cluster.token}   (export STAGETREE_TOKEN={cluster.token})", flush=True)
            print(
                f"  admin  {cluster.admin_token}   (stagetree hosts --token ...; set it with --admin-token)", flush=True
            )
            print(f"  data under {cluster.settings.home}; Ctrl-C stops", flush=True)
            status = asyncio.create_task(_status_lines(cluster, ns.status_every, sys.stdout))
            await done.wait()
            status.cancel()
            print("\nstopping ...", flush=True)

    try:
        asyncio.run(run())
    except FailedPrecondition as e:  # another master runs on this home
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e}; is another stagetree using port {ns.port}? pass --port 0", file=sys.stderr)
        return 1
    return 0


def status_line(cluster: Embedded) -> str:
    """``studies 2 | requests 3 waiting, 1 running, 40 done, 1 failed | slots 1/2 busy``, from the
    service layer (as the admin); ``slots 2/2 busy (2 sent ahead)`` when the scheduler sent batches to
    busy slots that are about to free (they are not counted busy twice)."""
    from stagetree.master.auth import ADMIN, Principal

    o = cluster.app.service.overview(Principal(ADMIN, admin=True))
    r = o.requests
    return (
        f"studies {o.studies} | requests {r.get('NOT_SCHED', 0)} waiting, {r.get('SCHED', 0)} running, "
        f"{r.get('DONE', 0)} done, {r.get('FAILED', 0)} failed, {r.get('CANCELLED', 0)} cancelled | "
        f"slots {o.slots_busy}/{o.slots} busy" + (f" ({o.slots_sent_ahead} sent ahead)" if o.slots_sent_ahead else "")
    )


async def _status_lines(cluster: Embedded, every_s: float, out: TextIO) -> None:
    """The status line every ``every_s`` seconds: rewritten in place on a terminal, else printed when it
    changes (one greppable line each)."""
    if every_s <= 0:
        return
    tty = out.isatty()
    last = ""
    while True:
        line = await asyncio.to_thread(status_line, cluster)
        if tty:
            out.write(f"\r\x1b[2K{line}")
            out.flush()
        elif line != last:
            print(line, file=out, flush=True)
        last = line
        await asyncio.sleep(every_s)


if __name__ == "__main__":
    sys.exit(main())
