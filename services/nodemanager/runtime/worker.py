"""The worker process: runs one batch, or with ``--serve`` batch after batch, in this process.

    python -m stagetree.nodemanager.runtime.worker --spec FILE.json --checkpoint-root DIR|URI
        [--s3-endpoint-url URL] [--cache-dir DIR] [--cache-bytes N]
        [--events-fd N] [--threads N] [--progress-interval S] [--serve]

* ``--spec -`` reads the spec from stdin (until EOF) once the imports are done: the node manager starts
  such a worker ahead of time and hands it a batch later. An empty stdin means "nothing to run" (exit 0).
  The input may start with a prepare line, ``{"prepare": {"fixed": FixedPart JSON, "gpus": n, "build":
  b}}``: the worker then imports that trainer's module while it waits and, with ``build`` (the default),
  builds the trainer (``prepare``; only for a trainer class with ``prepare_ahead``), and the batch
  starts from it when its fixed part is the same.
* ``--spec - --serve`` (the node manager's warm workers) reads one JSON line per batch,
  ``{"batch": BatchSpec JSON, "log": PATH}`` (prepare lines may come between them), and runs them one
  after another: the trainer's module is imported once, and a batch that starts at the point where the
  last one ended (same plan and fixed part) continues from the trainer in memory, with no ``init`` and
  no checkpoint read (``executor.InMemory``). The process's output goes to each batch's ``log`` from
  its start. After a batch that finished it writes ``worker_idle`` (``events.WORKER_EVENTS``: batches
  run, resident memory, processes left running) and waits for the next; after one that failed or was
  preempted, or a batch of several ranks, it exits (so a GPU's memory is freed with it), as it does at
  the end of its input.
* ``--preload a,b`` imports those modules before the spec is read (``torch._dynamo``, which the first
  optimizer a trainer builds imports, costs about as much as torch itself). ``--warm-cuda`` (a GPU
  slot's worker) creates the process's CUDA context and loads cuBLAS and cuDNN while it waits
  (``warm_cuda``), so a batch does not pay for them after it has its GPU.
* The trainer is ``spec.fixed.trainer``, an entry point ``"package.module:ClassName"``.
* Events are JSON lines (``events.encode_event``) on stdout, or on ``--events-fd``. With stdout, the
  process's fd 1 is pointed at stderr first, so a ``print`` in user code cannot corrupt the stream.
* Every event is written (and flushed) when it happens, except ``progress`` while steps are fast: the
  latest is held for up to 50 ms and replaces the ones before it (see ``EventWriter``), so a fast run
  reports progress some 20 times a second, not once per step.
* SIGTERM or SIGUSR1 preempts: the current step finishes, a peripheral checkpoint is saved,
  ``batch_preempted`` is emitted, the process exits 0. A signal that comes between two batches of a
  serving worker is forgotten when the next batch arrives.
* Exit codes: 0 finished or preempted; 1 the batch failed (after ``batch_failed``); 2 bad arguments
  or an unreadable spec. Any other code (a signal, ``os._exit``) means the process died unreported.
* ``run_forked`` is the same entry for a worker forked from the node manager's fork server.
* ``torch.set_num_threads`` comes from ``--threads``, else ``STAGETREE_WORKER_THREADS``, else 1.
* A rank of a batch on several slots finds its place in the spec's ``extra["rank"]``
  (``distributed.RankInfo``) and joins the group before it builds the trainer; only rank 0 writes
  events other than ``batch_failed``. A failure to join is the attempt's failure (retried).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import torch

from stagetree import logs
from stagetree.core.batch import BatchSpec
from stagetree.core.config import FixedPart
from stagetree.core.errors import StagetreeError
from stagetree.nodemanager.runtime.checkpoints import DEFAULT_CACHE_BYTES, CheckpointStore, open_checkpoint_store
from stagetree.nodemanager.runtime.distributed import SINGLE_RANK, RankGroup, join_group
from stagetree.nodemanager.runtime.events import encode_event
from stagetree.nodemanager.runtime.executor import BatchOutcome, BatchRun, InMemory, device_for, error_text, new_trainer
from stagetree.nodemanager.runtime.ranks import RankInfo
from stagetree.nodemanager.runtime.trainer import (
    EntryPointError,
    Trainer,
    TrainerModuleNotFound,
    load_trainer_class,
)
from stagetree.nodemanager.runtime.userpath import forget_edited_users_modules

log = logging.getLogger(__name__)

THREADS_ENV = "STAGETREE_WORKER_THREADS"
EXIT_FAILED = 1
EXIT_USAGE = 2


class EventWriter:
    """Writes one event per line, from whichever thread emits, and flushes it at once, except
    ``progress`` while steps are fast: progress is a status (the latest step subsumes the earlier
    ones), so a progress event that comes within ``progress_flush_s`` of the last flush is held, and
    replaced by the next one, until that interval has passed or another event is written (it then
    goes first, with its own time stamp). On this path a write and a flush per training step cost a
    small model several percent of its step time; now a fast run writes at most ``1 / progress_flush_s``
    progress lines a second, and every other event as soon as it happens."""

    def __init__(
        self, stream: TextIO, progress_flush_s: float = 0.05, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._progress_flush_s = progress_flush_s
        self._clock = clock
        self._last_flush = float("-inf")
        self._held: tuple[dict[str, Any], float] | None = None  # the latest progress not written yet

    def __call__(self, kind: str, payload: dict[str, Any]) -> None:
        with self._lock:
            now = self._clock()
            if kind == "progress" and now - self._last_flush < self._progress_flush_s:
                self._held = (payload, time.time())
                return
            self._write_held()
            self._stream.write(encode_event(kind, payload))
            self._stream.flush()
            self._last_flush = now

    def flush(self) -> None:
        """Write a held progress event, then flush."""
        with self._lock:
            self._write_held()
            self._stream.flush()

    def _write_held(self) -> None:
        if self._held is not None:
            payload, ts = self._held
            self._held = None
            self._stream.write(encode_event("progress", payload, ts))


def _events_stream(events_fd: int | None) -> TextIO:
    if events_fd is not None:
        return os.fdopen(events_fd, "w", encoding="utf-8")
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)  # user prints now land on stderr
    return os.fdopen(fd, "w", encoding="utf-8")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stagetree-worker", description="Run one stagetree batch.")
    p.add_argument("--spec", required=True, help="the batch spec (BatchSpec JSON) file, or - for stdin")
    p.add_argument("--checkpoint-root", required=True, help="checkpoint store root: a directory, file:// or s3:// URI")
    p.add_argument("--s3-endpoint-url", default="", help="an S3-compatible server for s3:// roots")
    p.add_argument("--cache-dir", default=None, help="the node manager's checkpoint cache (remote roots)")
    p.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES, help="the cache's size bound")
    p.add_argument("--events-fd", type=int, default=None, help="write events here instead of stdout")
    p.add_argument("--threads", type=int, default=None, help=f"torch threads (default ${THREADS_ENV} or 1)")
    p.add_argument(
        "--progress-interval", type=float, default=0.0, help="seconds between progress events (0: every step)"
    )
    p.add_argument("--preload", default="", help="comma-separated modules to import before reading the spec")
    p.add_argument(
        "--warm-cuda", action="store_true", help="create the CUDA context before reading the spec (GPU slots)"
    )
    p.add_argument("--serve", action="store_true", help="run batch after batch from stdin, one JSON line each")
    return p.parse_args(argv)


def warm_cuda() -> float:
    """Create this process's CUDA context and load cuBLAS and cuDNN (a small product, a small convolution
    and its backward), so that a batch arriving later starts training at once; the seconds it took (0.0
    without a usable GPU, logged). It holds the context's memory from now on, beside whatever batch runs
    on the slot meanwhile."""
    t0 = time.monotonic()
    try:
        if not torch.cuda.is_available():
            return 0.0
        a = torch.ones(16, 16, device="cuda")
        float((a @ a).sum())
        # and cuDNN: a first convolution loads its libraries (seconds from a cold disk)
        x = torch.ones(1, 2, 8, 8, device="cuda", requires_grad=True)
        w = torch.ones(2, 2, 3, 3, device="cuda", requires_grad=True)
        torch.nn.functional.conv2d(x, w, padding=1).sum().backward()  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
    except Exception as e:  # a broken driver is the batch's to report, with its own traceback
        log.warning("could not create the CUDA context ahead: %s: %s", type(e).__name__, e)
        return 0.0
    took = time.monotonic() - t0
    log.debug("CUDA context created ahead in %.2f s", took)
    return took


def process_started_at() -> float:
    """When this process started (epoch seconds): from ``/proc`` (to about 10 ms; a forked worker's is its
    fork), else now."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = int(after_name[19])  # field 22, starttime, in clock ticks after boot
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def main(argv: list[str] | None = None, spec_input: TextIO | None = None) -> int:
    given_at = process_started_at()  # a worker given its spec at launch: its start-up counts from here
    args = _parse_args(argv)
    logs.configure(os.environ.get("STAGETREE_LOG_LEVEL", "INFO"))
    threads = args.threads if args.threads is not None else int(os.environ.get(THREADS_ENV, "1"))
    torch.set_num_threads(max(1, threads))

    for name in filter(None, (m.strip() for m in args.preload.split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            log.warning("preload of %s failed: %s", name, e)
    if args.warm_cuda:
        warm_cuda()
    # What is imported by now lives as long as the process: kept out of the cyclic collector's scans, a
    # worker's full collections look at its own objects only, not at torch's and the user's modules
    # (forked ones: pages of the fork server's heap that a scan would copy). On tests/bench/userstyle's
    # no-sharing study (474 steps), 0.5-1.5 CPU-s less for its worker in three alternating pairs.
    gc.freeze()

    stream = spec_input if spec_input is not None else sys.stdin
    if args.serve:
        if args.spec != "-":
            log.error("--serve reads its batches from stdin: pass --spec -")
            return EXIT_USAGE
        return _Worker(args).serve(stream)

    prepared: Prepared | None = None
    try:
        if args.spec == "-":
            text = stream.readline()
            if text.startswith(PREPARE_PREFIX):
                prepared = prepare(text)
                text = ""
            text += stream.read()
            given_at = time.time()  # started ahead: what it did while it waited is no batch's start-up
            if not text.strip():
                log.debug("no batch spec on stdin: nothing to run")
                return 0
        else:
            text = Path(args.spec).read_text()
        spec = BatchSpec.from_json(json.loads(text))
        RankInfo.of_extra(spec.extra)
    except (OSError, ValueError, StagetreeError) as e:
        log.error("cannot start the batch: %s", e)
        return EXIT_USAGE
    worker = _Worker(args)
    if not worker.open_store():
        return EXIT_USAGE
    worker.prepared = prepared
    outcome = worker.run(spec, given_at)
    return EXIT_FAILED if outcome is None or outcome.status == "failed" else 0


class _Worker:
    """This process's part of running batches: its checkpoint store, event stream and preemption flag,
    opened once, and what a batch leaves for the next one on a worker that serves several (``--serve``):
    the trainer built ahead (``prepared``) and the one the last batch ended with (``kept``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.store: CheckpointStore | None = None
        self.preempt = threading.Event()
        self.prepared: Prepared | None = None
        self.kept: InMemory | None = None
        self.batches = 0
        self._stream_out: TextIO | None = None
        self._emit: EventWriter | None = None

    def open_store(self) -> bool:
        args = self.args
        try:
            self.store = open_checkpoint_store(
                args.checkpoint_root,
                s3_endpoint_url=args.s3_endpoint_url,
                cache_dir=args.cache_dir,
                cache_max_bytes=args.cache_bytes,
            )
        except (OSError, ValueError, StagetreeError) as e:
            log.error("cannot open the checkpoint store: %s", e)
            return False
        return True

    def _events(self) -> EventWriter:
        if self._emit is None:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGUSR1, self._on_signal)
            self._stream_out = _events_stream(self.args.events_fd)
            self._emit = EventWriter(self._stream_out)
        return self._emit

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: preempting after the current step", signum)
        self.preempt.set()

    def serve(self, stream: TextIO) -> int:
        """Run batch after batch, one JSON line each (``{"batch": spec, "log": path}``; prepare lines may
        come between them), until the end of the input (0) or a batch that did not finish: a failure
        (1), a preemption (0: the process goes, and a GPU's memory with it), a batch of several ranks."""
        if not self.open_store():
            return EXIT_USAGE
        emit = self._events()
        while True:
            line = stream.readline()
            if not line:
                log.debug("end of input: no more batches", extra={"batches": self.batches})
                return 0
            if line.startswith(PREPARE_PREFIX):
                self.prepared = prepare(line)
                continue
            given_at = time.time()  # what it did while it waited is no batch's start-up
            try:
                msg = json.loads(line)
                spec = BatchSpec.from_json(msg["batch"])
                rank = RankInfo.of_extra(spec.extra)
            except (ValueError, KeyError, TypeError, StagetreeError) as e:
                log.error("cannot start the batch: %s", e)
                return EXIT_USAGE
            if msg.get("log"):
                _log_to(str(msg["log"]))
            self.preempt.clear()  # a signal meant for the batch before (it had ended) is not this one's
            outcome = self.run(spec, given_at)
            if outcome is None or outcome.status != "finished" or rank.distributed:
                return EXIT_FAILED if outcome is None or outcome.status == "failed" else 0
            emit(
                "worker_idle",
                {"batches": self.batches, "rss_bytes": resident_bytes(), "children": len(child_pids())},
            )

    def run(self, spec: BatchSpec, given_at: float | None = None) -> BatchOutcome | None:
        """Run one batch handed over at ``given_at`` (epoch seconds); None when it could not start (its
        ``batch_failed`` is out)."""
        assert self.store is not None
        emit = self._events()
        rank = RankInfo.of_extra(spec.extra)
        ids = {"batch_id": spec.batch_id, "attempt": spec.attempt}
        kept, self.kept = self.kept, None
        if kept is not None and not (kept.fits(spec) and not rank.distributed):
            # The trainer of another path: its GPU memory goes before the next one is built. By the device
            # it ran on, not the batch's ``gpus`` (a CPU slot runs batches that ask for one): a full
            # collection with torch, scipy and sklearn imported costs some 0.3-0.6 s of CPU a batch.
            on_gpu, kept = kept.on_gpu, None
            if on_gpu:
                gc.collect()
        try:
            trainer_cls = load_trainer_class(spec.fixed.trainer)
        except Exception as e:  # the user's entry point does not import: a retry here would fail the same way
            tb = traceback.format_exc()
            log.error("cannot load the trainer %s: %s\n%s", spec.fixed.trainer, e, tb.rstrip(), extra=ids)
            # a module missing on this host is the host's problem (another node manager may have it); an
            # entry point naming nothing its module has needs no traceback of stagetree's frames
            failed = {
                "error": str(e) if isinstance(e, EntryPointError | TrainerModuleNotFound) else error_text(e, tb),
                "traceback": tb,
                "oom": False,
                "user_error": True,
                "host_problem": isinstance(e, ModuleNotFoundError),
            }
            emit("batch_failed", {**ids, **failed})
            return None

        group: RankGroup = SINGLE_RANK
        if rank.distributed:
            try:
                group = join_group(rank, device_for(spec.gpus))
            except Exception as e:  # a peer that never came, a port taken meanwhile: a retry may cure it
                tb = traceback.format_exc()
                log.error("cannot join the batch's process group: %s", e, extra=ids)
                failed = {
                    "error": error_text(e, tb),
                    "traceback": tb,
                    "oom": False,
                    "user_error": False,
                    "host_problem": False,
                }
                emit("batch_failed", {**ids, **failed})
                return None
        trainer = None
        prepared, self.prepared = self.prepared, None
        if prepared is not None and kept is None:
            if prepared.fits(spec) and not rank.distributed:
                trainer = prepared.trainer
                log.info("starting from the trainer built ahead", extra=ids)
            else:
                log.info("the trainer prepared ahead is for another fixed part; building the batch's own", extra=ids)
        prepared = None
        run = BatchRun(
            spec,
            trainer_cls,
            self.store,
            emit,
            self.preempt.is_set,
            progress_interval_s=self.args.progress_interval,
            prepared=trainer,
            group=group,
            given_at=given_at,
            continued=kept,
        )
        kept = None
        outcome = run.run()
        emit.flush()
        self.batches += 1
        if outcome.status == "finished" and run.trainer is not None and not rank.distributed:
            self.kept = InMemory.after(spec, run.trainer)
        if rank.distributed:
            # Leave now, with everything written: freeing the trainer (its DistributedDataParallel, the gloo
            # group) can block for good once a peer has gone (seen in forked workers), and a rank that does
            # not exit holds its slot until the node manager kills it.
            assert self._stream_out is not None
            self._stream_out.flush()
            exit_now(EXIT_FAILED if outcome.status == "failed" else 0)
        return outcome


def _log_to(path: str) -> None:
    """From now on, this process's stdout and stderr go to ``path`` (appended): each batch a worker runs
    has a log of its own, named by the node manager."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)  # the event stream is on a descriptor of its own (``_events_stream``)
    os.dup2(fd, 2)
    os.close(fd)


def resident_bytes() -> int:
    """This process's resident memory now (0 where ``/proc`` does not say)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def child_pids() -> list[int]:
    """The processes this process started that are still running (Linux; none found elsewhere)."""
    out: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


PREPARE_PREFIX = '{"prepare"'


@dataclass
class Prepared:
    """A trainer built ahead from a prepare line, and what it was built for."""

    fixed: FixedPart
    gpus: int
    trainer: Trainer

    def fits(self, spec: BatchSpec) -> bool:
        return self.fixed == spec.fixed and (self.gpus > 0) == (spec.gpus > 0)


def prepare(line: str) -> Prepared | None:
    """Import the trainer module that a prepare line ``{"prepare": {"fixed": ..., "gpus": n, "build": b}}``
    names while the worker waits for its batch, and with ``build`` (the default) build that trainer the
    way a batch of that fixed part builds it before loading its checkpoint (``executor.new_trainer``);
    only when the trainer class says its ``init`` may run ahead (``Trainer.prepare_ahead``). None,
    logged, when nothing was built or that failed: the batch then builds its own and reports the error
    as its own."""
    try:
        hint = json.loads(line)["prepare"]
        fixed = FixedPart.from_json(hint["fixed"])
        gpus = int(hint.get("gpus", 0))
        t0 = time.monotonic()
        trainer_cls = load_trainer_class(fixed.trainer)  # imported ahead in any case
        log.info("trainer %s imported ahead in %.2f s", fixed.trainer, time.monotonic() - t0)
        if not trainer_cls.prepare_ahead or not hint.get("build", True):
            return None
        trainer = new_trainer(trainer_cls, fixed, device_for(gpus))
    except Exception as e:  # user code: anything may come out of it
        log.warning("could not prepare the trainer ahead (the batch will build it): %s: %s", type(e).__name__, e)
        return None
    return Prepared(fixed, gpus, trainer)


def run_forked(
    argv: list[str], env: dict[str, str], unset: list[str], events: Any, log_path: str, spec_input: Any = None
) -> None:
    """Entry of a worker forked from the node manager's fork server (``nodemanager.workers``): leave the
    server's session, send stdout and stderr to ``log_path``, take the slot's environment (before
    anything reads it: CUDA is not initialized yet), and run ``main`` with events on ``events`` (the
    write end of a ``multiprocessing`` pipe) and, with ``--spec -``, the spec read from ``spec_input``
    (the read end of another)."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _own_std_streams()
    dropped = forget_edited_users_modules()  # forked from a script that imported them before an edit
    for key in unset:
        os.environ.pop(key, None)
    os.environ.update(env)
    events_fd = os.dup(events.fileno())
    events.close()
    spec_stream = None
    if spec_input is not None:
        spec_stream = os.fdopen(os.dup(spec_input.fileno()), "r", encoding="utf-8")
        spec_input.close()
    if dropped:
        print(f"stagetree worker: imports again the modules edited since its server forked: {dropped}", file=sys.stderr)
    sys.exit(main([*argv, "--events-fd", str(events_fd)], spec_stream))


def _own_std_streams() -> None:
    """``sys.stdout`` and ``sys.stderr`` on descriptors 1 and 2 (the batch's log), and no handler on the
    root logger, as in a fresh interpreter: a worker forked from a user's script (the embedded mode's fork
    server) inherits the script's streams and handlers, which may write to a test runner's capture or a
    notebook's."""
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, errors="backslashreplace")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown: everything the batch wrote is flushed and
    closed by then (``main`` drains the checkpoint writes and the event stream), and tearing down an
    interpreter that imported torch costs a worker almost a second of CPU per batch (measured)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
