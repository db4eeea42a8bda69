"""Worker processes: warm ones, kept per slot, each running batch after batch of one trainer.

A worker is started ahead for each slot (``runtime.worker --spec - --serve``: its imports done, it waits
for a batch on its input) and then runs the slot's batches one after another, each handed over as one
JSON line (``{"batch": spec, "log": path}``): the user's trainer module is imported once per worker, not
once per batch, and a batch that starts where the worker's last one ended continues from the trainer
in memory (no checkpoint read; ``runtime.executor.InMemory``). After each batch that finished, the
worker says ``worker_idle`` and waits; the batch's attempt is over for the node manager at that line.
``nodemanager.reuse`` decides, from plain data, whether a worker runs the next batch or is replaced:

* kept after a batch unless reuse is off, its batch left processes running, or its memory grew past
  the bound (a leak); a batch that failed or was preempted ends its worker (the process exits, and a
  GPU's memory is freed with it);
* given a batch only when it imported that batch's trainer and code version (or nothing yet);
  otherwise it is ended and another one started.

A worker runs in a session of its own (a Ctrl-C meant for the node manager does not reach it: the node
manager decides how its workers stop), gets its slot's environment (``slots.worker_env``), writes its
events as JSON lines into a pipe the node manager reads, and its stderr into a log file per batch under
``<work_dir>/logs`` (``batch-<id>-a<attempt>.log``), whose tail explains a crash.

A worker started ahead is told what to import (and, on a CPU slot with ``prepare``, which trainer to
build: ``Trainer.prepare_ahead``) from the work this node manager was sent: the last batch of its slot,
else the last batch sent at all. The node manager so preloads the trainer module of its work with no
setting. A GPU slot keeps one such worker beside the one running its batch (ready should that one
fail, be preempted or run another trainer); a CPU slot starts one only when its worker has gone, so
that it never takes the cores a batch is training on.

* ``ExecLauncher`` starts ``python -m stagetree.nodemanager.runtime.worker --spec - --serve`` per
  worker (the batches on stdin). Nothing is shared with the node manager.
* ``ForkserverLauncher`` forks each worker from a ``multiprocessing`` fork server that imported torch
  once (the batches on a pipe): a worker starts in milliseconds. The fork server never initializes CUDA
  (a process forked after that could not use it), so its children make their own contexts: ``auto``
  uses it on GPU machines too. On an H100 a Python started per batch cost some 5 s a batch, where the
  batches of a shared-prefix study train for a fraction of a second (``tests.bench.gpu``, docs/gpu.md).

What each process holds when it forks. The node manager (gRPC channels and their threads, an event
loop, pool threads) never forks with Python to run in the copy: ``ExecLauncher``'s workers and the fork
server itself start by ``vfork`` and ``exec`` (asyncio's subprocess, ``multiprocessing``'s
``spawnv_passfds``: no ``preexec_fn``), so no fork handler of gRPC runs. The fork server is one thread
holding the worker runtime, torch and ``preload`` imported, and nothing else: never gRPC (its threads and
fork handlers do not survive a fork) and never a CUDA context. ``ForkserverLauncher.start`` checks that
in the first process it forks (``fork_server_holds``) and refuses a server that holds either.

The embedded mode may make its fork server a fork of the user's script instead (``fork_this_process``,
taken first thing at its start): then the server holds what the script imported, gRPC's module among
them, but it forks only where ``fork_unsafe_reason`` finds nothing that a copy could not run: one Python
thread, no native thread of gRPC or CUDA (gRPC imported but never started has none: no channel, no
server, no fork handler to run), no CUDA context. The first process it forks checks the CUDA context
again (``_report_cuda``). Its workers rebind the script's standard streams and logging to their own
log, and import the user's modules again when any was edited after the fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import multiprocessing
import multiprocessing.context
import os
import signal
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from multiprocessing import popen_forkserver, spawn
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from stagetree.core.batch import BatchSpec
from stagetree.core.errors import FailedPrecondition, InvalidArgument, StagetreeError
from stagetree.core.failures import worker_log_name
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.reuse import ReusePolicy, TrainerKey, WorkerView, retire_after_batch, retire_before_batch
from stagetree.nodemanager.runtime import forked_worker_main
from stagetree.nodemanager.runtime.events import WORKER_EVENTS, decode_event
from stagetree.nodemanager.runtime.userpath import note_users_modules
from stagetree.nodemanager.slots import worker_env

log = logging.getLogger(__name__)

WORKER_MODULE = "stagetree.nodemanager.runtime.worker"
EXIT_FAILED = 1  # runtime.worker: the batch failed after reporting batch_failed
EXIT_USAGE = 2  # runtime.worker: bad arguments or an unreadable spec
MAX_LINE = 16 * 1024 * 1024  # one event line (a traceback can be long)


StartMethod = Literal["auto", "exec", "forkserver"]


class WorkerProcess(ABC):
    """One worker process: its events, signals and exit status, and what the node manager knows of it
    (``view``). While it runs a batch, ``events`` and ``wait`` are that batch's: they end when the worker
    says it is idle again (``worker_idle``, never yielded) or when it exits."""

    def __init__(
        self, slot: SlotInfo, log_path: Path, events: asyncio.StreamReader, stdin: asyncio.StreamWriter | None
    ) -> None:
        self.slot = slot
        self.log_path = log_path  # the running batch's log (the name it was started with, before its first)
        self.first_log = log_path
        self.killed = False  # killed by the node manager (SIGKILL)
        self.trainer: TrainerKey | None = None  # what it imported, ahead or for a batch
        self.batches = 0  # batches it ran to their end
        self.rss_bytes = 0
        self.first_rss_bytes = 0
        self.children = 0
        self._events = events
        self._stdin = stdin
        self._batch_over: asyncio.Future[None] | None = None
        self._on_idle: Callable[[WorkerProcess], None] | None = None

    async def send(self, data: bytes, *, close: bool) -> None:
        """Write to the worker's input (prepare lines, batches; ``close``: then the end of input)."""
        if self._stdin is None:
            raise BrokenPipeError("the worker's input is closed")
        self._stdin.write(data)
        await self._stdin.drain()
        if close:
            self._stdin.close()
            self._stdin = None

    def close_input(self) -> None:
        """Close the worker's input (a waiting worker reads its end and exits)."""
        stdin, self._stdin = self._stdin, None
        if stdin is not None:
            with contextlib.suppress(Exception):
                stdin.close()

    def begin_batch(self, log_path: Path, on_idle: Callable[[WorkerProcess], None]) -> None:
        """The worker is handed a batch: ``events`` and ``wait`` are that batch's from now on, and
        ``on_idle`` is called (before either returns) when the worker says it waits for the next one."""
        self.log_path = log_path
        self._batch_over = asyncio.get_running_loop().create_future()
        self._on_idle = on_idle

    def view(self) -> WorkerView:
        return WorkerView(
            trainer=self.trainer,
            batches=self.batches,
            rss_bytes=self.rss_bytes,
            first_rss_bytes=self.first_rss_bytes,
            children=self.children,
            exited=self.killed or self.returncode is not None,
        )

    @property
    @abstractmethod
    def pid(self) -> int: ...

    @property
    @abstractmethod
    def returncode(self) -> int | None:
        """The exit status (negative: the signal that killed it); None while it runs."""

    @abstractmethod
    async def wait(self) -> int:
        """The end of its batch: 0 once it says it is idle again, else its exit status once it has exited
        (whoever still holds its pipes)."""

    async def wait_exit(self) -> int:
        """The exit status, once the process has exited."""
        return await self.wait()

    async def _batch_over_or_exit(self) -> int:
        """0 when the running batch is over with the worker idle, else the exit status."""
        over = self._batch_over
        if over is None:
            return await self.wait_exit()
        exit_wait = asyncio.ensure_future(self.wait_exit())
        waits: set[asyncio.Future[Any]] = {over, exit_wait}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            return 0 if over.done() else exit_wait.result()
        finally:
            exit_wait.cancel()

    async def events(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """``(kind, payload)`` of each event of the running batch, until the worker says it is idle or
        closes its end of the pipe; malformed lines are logged and skipped."""
        while True:
            try:
                line = await self._events.readline()
            except ValueError:  # a line over the limit: skip to the next one
                log.warning("oversized worker output line skipped", extra={"pid": self.pid})
                continue
            if not line:
                return
            try:
                kind, _ts, payload = decode_event(line)
            except StagetreeError as e:
                log.warning("malformed worker event skipped: %s", e.message, extra={"pid": self.pid})
                continue
            if kind in WORKER_EVENTS:
                if kind == "worker_idle":
                    self._idle(payload)
                    return
                continue
            yield kind, payload

    def _idle(self, payload: dict[str, Any]) -> None:
        self.batches = int(payload["batches"])
        self.rss_bytes = int(payload["rss_bytes"])
        if not self.first_rss_bytes:
            self.first_rss_bytes = self.rss_bytes
        self.children = int(payload["children"])
        over, self._batch_over = self._batch_over, None
        if over is not None and not over.done():
            over.set_result(None)
        on_idle, self._on_idle = self._on_idle, None
        if on_idle is not None:
            on_idle(self)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the worker and anything it started in its session."""
        if self.returncode is None:
            self.killed = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def kill_session(self) -> None:
        """SIGKILL what is left of the worker's session (processes it forked and did not stop)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def stderr_tail(self, max_bytes: int = 4000) -> str:
        """The end of the worker's log of its batch (its stderr)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_bytes))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""


def _alive(worker: WorkerProcess | None) -> bool:
    return worker is not None and not worker.killed and worker.returncode is None


class WorkerLauncher(ABC):
    """Hands batches to the warm worker processes of each slot, starting them as needed."""

    def __init__(
        self,
        checkpoint_root: str,
        work_dir: Path,
        *,
        threads: int = 1,
        progress_interval_s: float = 1.0,
        preload: Sequence[str] = (),
        mps_env: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        prestart: bool = True,
        prepare: bool = True,
        checkpoint_args: Sequence[str] = (),
        warm_cuda: bool = False,
        reuse: ReusePolicy | None = None,
    ) -> None:
        self.checkpoint_root = checkpoint_root
        self.checkpoint_args = list(checkpoint_args)  # the store's other options (endpoint, cache)
        self.log_dir = work_dir / "logs"
        self.threads = threads
        self.progress_interval_s = progress_interval_s
        self.preload = [m for m in preload if m]
        self.mps_env = dict(mps_env or {})
        self.extra_env = dict(extra_env or {})
        self.prestart = prestart
        self.prepare = prepare
        self.warm_cuda = warm_cuda  # a GPU slot's worker creates its CUDA context while it waits
        self.reuse = reuse or ReusePolicy()
        self._seq = itertools.count()
        self._fresh: dict[str, WorkerProcess] = {}  # slot -> a worker started ahead that ran no batch yet
        self._used: dict[str, WorkerProcess] = {}  # slot -> a worker that ran batches there, waiting
        self._busy: dict[str, WorkerProcess] = {}  # slot -> the worker running its batch
        self._spawning: set[str] = set()  # slots whose next batch is being handed to a worker
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._waiting: set[asyncio.Task[None]] = set()  # what waits for a worker's exit (_after_exit)
        self._last: dict[str, BatchSpec] = {}  # slot -> the last batch it was given
        self._latest: BatchSpec | None = None  # the last batch given to any slot
        self._slots: dict[str, SlotInfo] = {}
        self._closed = False

    def worker_args(self, slot: SlotInfo | None = None) -> list[str]:
        """The worker's arguments (after ``python -m runtime.worker``) for a worker on ``slot``, without
        ``--spec``."""
        warm = ["--warm-cuda"] if self.warm_cuda and slot is not None and slot.is_gpu else []
        return [
            "--checkpoint-root",
            self.checkpoint_root,
            *self.checkpoint_args,
            "--threads",
            str(self.threads),
            "--progress-interval",
            str(self.progress_interval_s),
            "--serve",
            *warm,
        ]

    def env(self, slot: SlotInfo, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = worker_env(slot, threads=self.threads, mps_env=self.mps_env, base=base)
        env.update(self.extra_env)
        return env

    def log_path(self, name: str) -> Path:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / name

    def batch_logs(self, batch_id: int, attempt: int) -> list[Path]:
        """The logs of a batch attempt's workers that are still here (one per rank of a batch on several
        slots), by the names ``spawn`` gives them."""
        names = [worker_log_name(batch_id, attempt), worker_log_name(batch_id, attempt, "-r*")]
        return [p for name in names for p in sorted(self.log_dir.glob(name))]

    @abstractmethod
    async def _start(self, slot: SlotInfo) -> WorkerProcess:
        """A worker process for ``slot`` that has done its imports and reads its batches from ``stdin``
        (``runtime.worker --spec - --serve``); OSError when it cannot be started."""

    async def start(self, slots: Sequence[SlotInfo]) -> None:
        """Get ready to run batches quickly: with ``prestart``, a worker started ahead for each slot."""
        for slot in slots:
            self._slots[slot.id] = slot
            self._replenish(slot)

    async def _new(self, slot: SlotInfo) -> WorkerProcess:
        worker = await self._start(slot)
        self._after_exit(worker, lambda: self._exited(worker))
        return worker

    def _replenish(self, slot: SlotInfo) -> None:
        """Start a worker ahead for ``slot`` in the background, unless one is waiting there or starting;
        on a CPU slot also unless a worker runs there or waits with its last batch's trainer. It is told
        what to import (``_hint``)."""
        if self._closed or not self.prestart or slot.id in self._starting or _alive(self._fresh.get(slot.id)):
            return
        busy = slot.id in self._spawning or _alive(self._busy.get(slot.id))
        if not slot.is_gpu and (busy or _alive(self._used.get(slot.id))):
            return

        async def start() -> None:
            try:
                worker = await self._new(slot)
            except OSError as e:
                log.error("cannot prestart a worker: %s", e, extra={"slot_id": slot.id})
                return
            finally:
                self._starting.pop(slot.id, None)
            if self._closed:
                worker.kill()
                await worker.wait_exit()
                return
            self._fresh[slot.id] = worker
            await self._hint(worker, slot)

        self._starting[slot.id] = asyncio.get_running_loop().create_task(start())

    async def _hint(self, worker: WorkerProcess, slot: SlotInfo) -> None:
        """Tell a worker that ran nothing yet which trainer to import ahead (and, on a CPU slot with
        ``prepare``, to build: ``runtime.worker``'s prepare line): that of the slot's last batch, else of
        the last batch this node manager was sent (the study's entry point)."""
        spec = self._last.get(slot.id) or self._latest
        if spec is None or worker.trainer is not None or worker.batches:
            return
        worker.trainer = TrainerKey(spec.fixed.trainer, spec.fixed.code_version)
        # On a GPU slot a trainer built ahead would take memory beside the batch running there: import only.
        line = prepare_line(spec, build=self.prepare and not slot.is_gpu)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await worker.send(line, close=False)

    async def spawn(self, spec: BatchSpec, slot: SlotInfo) -> WorkerProcess:
        """The worker running ``spec`` on ``slot`` (OSError when none can be started): the slot's waiting
        worker that last ran a batch there, else the one started ahead, when it may run this batch's
        trainer (``reuse.retire_before_batch``; one that may not is ended), else one started now."""
        self._slots[slot.id] = slot
        self._spawning.add(slot.id)  # a worker that exits meanwhile is not replaced ahead: this batch takes one
        try:
            return await self._spawn(spec, slot)
        finally:
            self._spawning.discard(slot.id)

    async def _spawn(self, spec: BatchSpec, slot: SlotInfo) -> WorkerProcess:
        starting = self._starting.get(slot.id)
        if starting is not None:
            await asyncio.shield(starting)
        needs = TrainerKey(spec.fixed.trainer, spec.fixed.code_version)
        worker: WorkerProcess | None = None
        for pool in (self._used, self._fresh):
            candidate = pool.pop(slot.id, None)
            if candidate is None:
                continue
            why = retire_before_batch(candidate.view(), needs)
            if why is not None:
                log.info("worker replaced: %s", why, extra={"slot_id": slot.id, "pid": candidate.pid})
                self._retire(candidate)
            elif worker is None:
                worker = candidate
            else:
                pool[slot.id] = candidate  # a GPU slot's worker started ahead stays the spare
        if worker is None:
            worker = await self._new(slot)
        # A batch's log is named after it. A worker's first batch takes the log it was started with (its
        # imports' output) as a second link to the same file; the worker opens the batch's name itself
        # (a forked worker opens its log by the name it was started with, and one started a moment ago
        # may not have yet: the first name goes when the worker has exited).
        rank = spec.extra.get("rank")  # a rank of a batch on several slots: a log per rank
        suffix = f"-r{int(rank['rank'])}" if isinstance(rank, dict) and "rank" in rank else ""
        final = self.log_path(worker_log_name(spec.batch_id, spec.attempt, suffix))
        with contextlib.suppress(FileNotFoundError):
            final.unlink()  # an earlier process's log of the same attempt
        try:
            if worker.log_path == worker.first_log:
                os.link(worker.first_log, final)
            else:
                final.touch()
        except OSError as e:
            log.debug("batch log %s not created ahead: %s", final, e)
        worker.trainer = needs
        worker.begin_batch(final, lambda w: self._returned(w, slot))
        self._busy[slot.id] = worker
        self._last[slot.id] = self._latest = spec
        line = json.dumps({"batch": spec.to_json(), "log": str(final)}, separators=(",", ":")).encode() + b"\n"
        try:
            await worker.send(line, close=False)
        except (BrokenPipeError, ConnectionResetError) as e:
            # The waiting process died in between; its exit is what the caller will see and report.
            log.warning("worker died before it got its batch: %s", e, extra={"batch_id": spec.batch_id})
        if slot.is_gpu:
            self._replenish(slot)
        await self._hint_others(slot)
        return worker

    async def _hint_others(self, slot: SlotInfo) -> None:
        """Workers started ahead on the other slots that imported nothing yet import this batch's trainer
        now, while they wait (the node manager preloads the trainer module of the work it is sent)."""
        for other, worker in list(self._fresh.items()):
            if other != slot.id and _alive(worker) and worker.trainer is None and other in self._slots:
                await self._hint(worker, self._slots[other])

    def _returned(self, worker: WorkerProcess, slot: SlotInfo) -> None:
        """A worker's batch finished and it waits for the next one: kept for the slot, or ended
        (``reuse.retire_after_batch``). Called as the worker says so, before its attempt is over for the
        node manager, so that the slot's next batch finds it."""
        if self._busy.get(slot.id) is worker:
            del self._busy[slot.id]
        if self._closed:
            self._retire(worker)
            return
        why = retire_after_batch(worker.view(), self.reuse)
        if why is not None:
            log.info("worker not kept: %s", why, extra={"slot_id": slot.id, "pid": worker.pid})
            self._retire(worker)
            self._replenish(slot)
            return
        other = self._used.pop(slot.id, None)
        if other is not None and other is not worker:
            self._retire(other)
        self._used[slot.id] = worker

    def _retire(self, worker: WorkerProcess) -> None:
        """End a waiting worker (and whatever its batches left running in its session)."""
        worker.kill()
        worker.kill_session()
        worker.close_input()

    def _exited(self, worker: WorkerProcess) -> None:
        """A worker has exited: forget it, drop its first log name once a batch's name links the same
        file (a worker that ran nothing keeps no log), and start the slot's next one ahead."""
        slot = worker.slot
        worker.close_input()
        for pool in (self._fresh, self._used, self._busy):
            if pool.get(slot.id) is worker:
                del pool[slot.id]
        if worker.log_path != worker.first_log or (worker.killed and not worker.batches):
            worker.first_log.unlink(missing_ok=True)
        self._replenish(self._slots.get(slot.id, slot))

    def _after_exit(self, worker: WorkerProcess, *then: Callable[[], None]) -> None:
        async def wait_then() -> None:
            with contextlib.suppress(Exception):
                await worker.wait_exit()
            for f in then:
                try:
                    f()
                except Exception:
                    log.exception("after a worker's exit")

        task = asyncio.get_running_loop().create_task(wait_then())
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)

    async def close(self) -> None:
        """Stop the waiting workers (running workers belong to their callers: they exit at their batch's
        end)."""
        self._closed = True
        for t in list(self._waiting):  # their workers belong to the callers; nothing more to start
            t.cancel()
        if self._starting:
            await asyncio.wait(list(self._starting.values()), timeout=30)
        for w in self._busy.values():  # each exits at the end of its batch instead of waiting for another
            w.close_input()
        waiting = [*self._fresh.values(), *self._used.values()]
        self._fresh, self._used = {}, {}
        for w in waiting:
            w.kill()
            w.close_input()
        for w in waiting:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(w.wait_exit(), 10)
            w.first_log.unlink(missing_ok=True)  # a batch's name links the same file, if it ran one


def prepare_line(spec: BatchSpec, *, build: bool = True) -> bytes:
    """The line that asks a waiting worker to import the trainer of ``spec``'s fixed part ahead, and with
    ``build`` to build it (``runtime.worker.prepare``)."""
    return json.dumps({"prepare": {"fixed": spec.fixed.to_json(), "gpus": spec.gpus, "build": build}}).encode() + b"\n"


# -- one exec per worker ---------------------------------------------------------------------------


class _ExecWorker(WorkerProcess):
    def __init__(self, proc: asyncio.subprocess.Process, slot: SlotInfo, log_path: Path) -> None:
        assert proc.stdout is not None
        super().__init__(slot, log_path, proc.stdout, proc.stdin)
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self._batch_over_or_exit()

    async def wait_exit(self) -> int:
        # Not proc.wait(): it also waits for the pipes to close, which a process the worker forked
        # (a data-loader worker) can keep open after the worker itself is gone.
        while self.proc.returncode is None:
            await asyncio.sleep(0.05)
        return self.proc.returncode


class ExecLauncher(WorkerLauncher):
    """``python -m stagetree.nodemanager.runtime.worker --spec - --serve`` per worker; with ``prestart``,
    one started ahead per slot (its imports and ``preload`` done, waiting for batches on stdin)."""

    def __init__(self, checkpoint_root: str, work_dir: Path, *, python: str = sys.executable, **kw: Any) -> None:
        super().__init__(checkpoint_root, work_dir, **kw)
        self.python = python

    def command(self, slot: SlotInfo | None = None) -> list[str]:
        preload = ["--preload", ",".join(self.preload)] if self.preload else []
        return [self.python, "-m", WORKER_MODULE, "--spec", "-", *self.worker_args(slot), *preload]

    async def _start(self, slot: SlotInfo) -> _ExecWorker:
        path = self.log_path(f"worker-{slot.id}-{os.getpid()}-{next(self._seq)}.log")
        with open(path, "ab") as err:
            proc = await asyncio.create_subprocess_exec(
                *self.command(slot),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env=self.env(slot),
                start_new_session=True,
                limit=MAX_LINE,
            )
        log.debug("worker process started", extra={"pid": proc.pid, "slot_id": slot.id})
        return _ExecWorker(proc, slot, path)


# -- forked from a fork server ---------------------------------------------------------------------


class _ForkedWorker(WorkerProcess):
    def __init__(
        self, proc: Any, slot: SlotInfo, log_path: Path, events: asyncio.StreamReader, stdin: asyncio.StreamWriter
    ) -> None:
        super().__init__(slot, log_path, events, stdin)
        self.proc = proc  # multiprocessing.Process (forkserver context)
        self._pid: int = proc.pid
        self._exited: asyncio.Future[int] | None = None

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        if self._exited is not None and self._exited.done():
            return self._exited.result()
        return None

    async def wait(self) -> int:
        return await self._batch_over_or_exit()

    async def wait_exit(self) -> int:
        if self._exited is None:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[int] = loop.create_future()
            self._exited = fut
            sentinel = self.proc.sentinel

            def on_exit() -> None:
                loop.remove_reader(sentinel)
                self.proc.join(0)
                if not fut.done():
                    fut.set_result(int(self.proc.exitcode if self.proc.exitcode is not None else -1))

            loop.add_reader(sentinel, on_exit)
        return await asyncio.shield(self._exited)


class ForkserverLauncher(WorkerLauncher):
    """Forks each worker from a ``multiprocessing`` fork server that imported the worker runtime (and
    ``preload``) once. The fork server is started by ``start`` (in a thread: it takes the import time)
    unless it runs already (``ensure_fork_server``); with ``prestart``, a worker is forked ahead for each
    slot and waits for its batches on a pipe."""

    def __init__(self, checkpoint_root: str, work_dir: Path, **kw: Any) -> None:
        super().__init__(checkpoint_root, work_dir, **kw)
        self._ctx = multiprocessing.get_context("forkserver")

    async def start(self, slots: Sequence[SlotInfo]) -> None:
        await asyncio.to_thread(ensure_fork_server, self.preload)
        await super().start(slots)

    async def _start(self, slot: SlotInfo) -> _ForkedWorker:
        log_path = self.log_path(f"worker-{slot.id}-{os.getpid()}-{next(self._seq)}.log")
        log_path.touch()  # here, not by the child: spawn may rename it before the child runs
        events_read, events_write = self._ctx.Pipe(duplex=False)
        spec_read, spec_write = self._ctx.Pipe(duplex=False)
        # Only what differs from the fork server's environment (inherited from this process).
        env = self.env(slot)
        changes = {k: v for k, v in env.items() if os.environ.get(k) != v}
        removed = [k for k in os.environ if k not in env]
        argv = ["--spec", "-", *self.worker_args(slot)]
        proc = _WorkerForkProcess(
            target=forked_worker_main,
            args=(argv, changes, removed, events_write, str(log_path), spec_read),
            name=f"worker-{slot.id}",
            daemon=False,
        )
        try:
            await asyncio.to_thread(proc.start)
        except BaseException:
            spec_write.close()
            events_read.close()
            raise
        finally:
            events_write.close()
            spec_read.close()
        reader = await _stream_reader(events_read)
        writer = await _stream_writer(spec_write)
        log.debug("worker process forked", extra={"pid": proc.pid, "slot_id": slot.id})
        return _ForkedWorker(proc, slot, log_path, reader, writer)


def fork_server_holds() -> list[str]:
    """What this process holds that a process forked from it cannot use: gRPC (imported: its threads
    and fork handlers are not a fork's to run) and an initialized CUDA context. Run in a child of the
    fork server, it describes the server (a fork copies every module)."""
    held = [m for m in ("grpc",) if m in sys.modules]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        held.append("a CUDA context")
    return held


def _report_holdings(conn: Connection) -> None:
    conn.send(fork_server_holds())
    conn.close()


def _report_cuda(conn: Connection) -> None:
    conn.send([h for h in fork_server_holds() if h != "grpc"])
    conn.close()


_FORK_SERVER = threading.Lock()
_fork_server_preload: tuple[str, ...] | None = None
_zygote_pid: int | None = None  # the fork server is a fork of this process (``fork_this_process``)

# the names native threads of gRPC and CUDA go by (a thread of a BLAS or OpenMP pool keeps the process's)
_UNSAFE_THREAD_NAMES = ("grpc", "event_engine", "lifeguard", "default-executo", "resolver", "cuda")


def fork_unsafe_reason() -> str | None:
    """Why forking this process now would give a copy that cannot run workers, or ``None`` where it can:
    another Python thread (it may hold a lock the copy would wait on forever), a live gRPC (its threads
    and fork handlers), a CUDA context, a platform with no ``fork`` or a ``multiprocessing`` whose fork
    server this module does not know."""
    from multiprocessing import forkserver

    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return "this platform has no fork"
    if not hasattr(forkserver, "_forkserver") or hasattr(forkserver._forkserver, "_forkserver_authkey"):
        return "this Python's fork server takes more than a listener and a pipe"
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} other Python thread(s) run"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "it holds a CUDA context"
    try:
        names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    except OSError:
        return "its threads cannot be listed"
    unsafe = sorted({n for n in names if n.startswith(_UNSAFE_THREAD_NAMES)})
    return f"native threads of gRPC or CUDA run ({', '.join(unsafe)})" if unsafe else None


def fork_this_process(preload: Sequence[str] = ()) -> str | None:
    """Make a fork of this process the workers' fork server, where that is safe (``fork_unsafe_reason``):
    the server then holds every module this process imported (a user's script: torch, the trainer's
    module and what it imports), so neither it nor its workers import them again. Call it first thing,
    on the main thread, before this process starts threads, gRPC or CUDA. The server imports the worker
    runtime and ``preload`` itself, beside this process. Returns why not where it did not fork (the
    caller then gets a fresh server from ``ensure_fork_server``)."""
    import socket
    from multiprocessing import connection, forkserver, resource_tracker, util

    global _zygote_pid
    with _FORK_SERVER:
        if _zygote_pid is not None or _fork_server_preload is not None:
            return "a fork server runs already"
        why = fork_unsafe_reason()
        if why:
            return why
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        wanted = [WORKER_MODULE, *(m for m in preload if m)]
        resource_tracker.ensure_running()  # a process of its own (spawned): the server's children share it
        server: Any = forkserver._forkserver  # its fields are multiprocessing's, set as ensure_running sets them
        if server._forkserver_pid is not None:
            return "this process runs a multiprocessing fork server already"
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener = socket.socket(socket.AF_UNIX)
        try:
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()  # or the copy writes this process's buffered output again
            pid = os.fork()
            if pid == 0:  # the copy: serve forks until every holder of the pipe's write end has exited
                code = 0
                try:
                    os.close(alive_w)
                    os.setpgid(0, 0)  # a Ctrl-C at the terminal is for the script, not for the server
                    note_users_modules()  # a worker imports again those edited after this
                    forkserver.main(listener.fileno(), alive_r, wanted)
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 0
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            os.close(alive_r)
        finally:
            listener.close()
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
        server._preload_modules = wanted  # should it die: the fresh one ensure_running starts imports these
        _zygote_pid = pid
        log.debug("the workers' fork server is a fork of this process", extra={"pid": pid})
        return None


def ensure_fork_server(preload: Sequence[str] = ()) -> None:
    """Start this process's fork server, which imports the worker runtime and ``preload`` (torch:
    seconds), and return once it has (blocking: call it in a thread). Later calls return at once; a
    caller may start it early (the embedded mode does, beside its own start-up) so that the node
    manager's launcher finds it ready. Its preload is fixed by the first call."""
    from multiprocessing import forkserver

    global _fork_server_preload
    with _FORK_SERVER:
        wanted = (WORKER_MODULE, *(m for m in preload if m))
        if _fork_server_preload is not None:
            if set(wanted) - set(_fork_server_preload):
                log.warning(
                    "the fork server runs already; modules not preloaded in it: %s",
                    sorted(set(wanted) - set(_fork_server_preload)),
                )
            forkserver.ensure_running()  # started again should it have died
            return
        # The server must never initialize CUDA (a process forked after that cannot use it): should
        # anything it imports ask PyTorch whether CUDA is available, the answer comes from NVML.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        ctx = multiprocessing.get_context("forkserver")
        forked = _zygote_pid is not None
        if not forked:
            # Only our modules: the default would import the node manager's __main__ in the server.
            ctx.set_forkserver_preload(list(wanted))
            forkserver.ensure_running()
        # The server imports its preload (torch: seconds) after it starts: fork one child and wait
        # for it, so that time is spent here and not by the first batch. The child holds what the
        # server held when it forked: it says whether that is safe to fork.
        answer, ask = ctx.Pipe(duplex=False)
        # A fork of this process imported gRPC but never ran it (``fork_unsafe_reason``): only CUDA counts.
        check = _report_cuda if forked else _report_holdings
        warm = _WorkerForkProcess(target=check, args=(ask,), name="forkserver-warmup", daemon=True)
        try:
            warm.start()
            ask.close()
            warm.join(timeout=120)
            held: list[str] = answer.recv() if answer.poll(0) else []
        finally:
            answer.close()
        if held:
            raise FailedPrecondition(
                f"the worker fork server holds {' and '.join(held)} (preload {list(preload)}), which a forked "
                "worker cannot use: keep them out of the modules it preloads, or set worker_start=exec"
            )
        _fork_server_preload = wanted


_LAUNCHING = threading.Lock()  # one worker launch at a time replaces get_preparation_data


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """While a worker is launched: ``multiprocessing.spawn.get_preparation_data`` without the main
    module, for the launching thread only (another thread's process, a user's spawn say, still imports
    its ``__main__``); the original is back when the launch returns."""
    with _LAUNCHING:
        original = spawn.get_preparation_data
        launching = threading.get_ident()

        def preparation_data(name: str) -> dict[str, Any]:
            data: dict[str, Any] = original(name)
            if threading.get_ident() == launching:
                data.pop("init_main_from_name", None)
                data.pop("init_main_from_path", None)
            return data

        spawn.get_preparation_data = preparation_data
        try:
            yield
        finally:
            spawn.get_preparation_data = original


class _WorkerPopen(popen_forkserver.Popen):
    """Forks a worker without the parent's ``__main__``: multiprocessing would import the node manager's
    (or the user script's) main module again in every worker, which costs each batch its import time
    and runs a script's top level in the worker unless it has an ``if __name__ == "__main__":`` guard.
    The worker's target lives in this package, so it needs nothing from ``__main__``."""

    def _launch(self, process_obj: Any) -> None:
        with _without_main():
            super()._launch(process_obj)  # type: ignore[misc]


class _WorkerForkProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _WorkerPopen(process_obj)


async def _stream_writer(conn: Connection) -> asyncio.StreamWriter:
    """An asyncio writer over the write end of a pipe (taking the descriptor over from ``conn``)."""
    loop = asyncio.get_running_loop()
    fd = os.dup(conn.fileno())
    conn.close()
    pipe = os.fdopen(fd, "wb", buffering=0)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, pipe)
    return asyncio.StreamWriter(transport, protocol, None, loop)


async def _stream_reader(conn: Connection) -> asyncio.StreamReader:
    """An asyncio reader over the read end of a pipe (taking the descriptor over from ``conn``)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE, loop=loop)
    fd = os.dup(conn.fileno())
    conn.close()
    pipe = os.fdopen(fd, "rb", buffering=0)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    return reader


def make_launcher(
    method: StartMethod,
    slots: Sequence[SlotInfo],
    checkpoint_root: str,
    work_dir: Path,
    *,
    prestart: bool = True,
    **kw: Any,
) -> WorkerLauncher:
    """The launcher for ``method``; ``auto`` forks from a fork server, whatever the ``slots`` (GPU slots
    included: see the module doc)."""
    if method == "auto":
        method = "forkserver"
    if method == "exec":
        return ExecLauncher(checkpoint_root, work_dir, prestart=prestart, **kw)
    if method == "forkserver":
        return ForkserverLauncher(checkpoint_root, work_dir, prestart=prestart, **kw)
    raise InvalidArgument(f"worker start method {method!r}; known: ['auto', 'exec', 'forkserver']")
