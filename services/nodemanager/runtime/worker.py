"""The worker process: runs one batch and exits (so its GPU memory is freed with it).

    python -m stagetree.nodemanager.runtime.worker --spec FILE.json --checkpoint-root DIR|URI
        [--s3-endpoint-url URL] [--cache-dir DIR] [--cache-bytes N]
        [--events-fd N] [--threads N] [--progress-interval S]

* ``--spec -`` reads the spec from stdin (until EOF) once the imports are done: the node manager starts
  such a worker ahead of time and hands it a batch later. An empty stdin means "nothing to run" (exit 0).
  The input may start with a prepare line, ``{"prepare": {"fixed": FixedPart JSON, "gpus": n}}``: the
  worker then builds that trainer while it waits (``prepare``; only for a trainer class with
  ``prepare_ahead``), and the batch starts from it when its fixed part is the same.
  ``--preload a,b`` imports those modules before the spec is read (``torch._dynamo``, which the first
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
  ``batch_preempted`` is emitted, the process exits 0.
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
import importlib
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
from stagetree.nodemanager.runtime.checkpoints import DEFAULT_CACHE_BYTES, open_checkpoint_store
from stagetree.nodemanager.runtime.distributed import SINGLE_RANK, RankGroup, join_group
from stagetree.nodemanager.runtime.events import encode_event
from stagetree.nodemanager.runtime.executor import BatchRun, device_for, error_text, new_trainer
from stagetree.nodemanager.runtime.ranks import RankInfo
from stagetree.nodemanager.runtime.trainer import Trainer, load_trainer_class

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

    prepared: Prepared | None = None
    try:
        if args.spec == "-":
            stream = spec_input if spec_input is not None else sys.stdin
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
        rank = RankInfo.of_extra(spec.extra)
        store = open_checkpoint_store(
            args.checkpoint_root,
            s3_endpoint_url=args.s3_endpoint_url,
            cache_dir=args.cache_dir,
            cache_max_bytes=args.cache_bytes,
        )
    except (OSError, ValueError, StagetreeError) as e:
        log.error("cannot start the batch: %s", e)
        return EXIT_USAGE

    preempt = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: preempting after the current step", signum, extra={"batch_id": spec.batch_id})
        preempt.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGUSR1, on_signal)

    stream_out = _events_stream(args.events_fd)
    emit = EventWriter(stream_out)
    ids = {"batch_id": spec.batch_id, "attempt": spec.attempt}
    try:
        trainer_cls = load_trainer_class(spec.fixed.trainer)
    except Exception as e:  # the user's entry point does not import: a retry would fail the same way
        tb = traceback.format_exc()
        log.error("cannot load the trainer %s: %s\n%s", spec.fixed.trainer, e, tb.rstrip(), extra=ids)
        emit("batch_failed", {**ids, "error": error_text(e, tb), "traceback": tb, "oom": False, "user_error": True})
        return EXIT_FAILED

    group: RankGroup = SINGLE_RANK
    if rank.distributed:
        try:
            group = join_group(rank, device_for(spec.gpus))
        except Exception as e:  # a peer that never came, a port taken meanwhile: a retry may cure it
            tb = traceback.format_exc()
            log.error("cannot join the batch's process group: %s", e, extra=ids)
            failed = {"error": error_text(e, tb), "traceback": tb, "oom": False, "user_error": False}
            emit("batch_failed", {**ids, **failed})
            return EXIT_FAILED
    trainer = None
    if prepared is not None:
        if prepared.fits(spec) and not rank.distributed:
            trainer = prepared.trainer
            log.info("starting from the trainer built ahead", extra=ids)
        else:
            log.info("the trainer prepared ahead is for another fixed part; building the batch's own", extra=ids)
        prepared = None
    run = BatchRun(
        spec,
        trainer_cls,
        store,
        emit,
        preempt.is_set,
        progress_interval_s=args.progress_interval,
        prepared=trainer,
        group=group,
        given_at=given_at,
    )
    outcome = run.run()
    emit.flush()
    code = EXIT_FAILED if outcome.status == "failed" else 0
    if rank.distributed:
        # Leave now, with everything written: freeing the trainer (its DistributedDataParallel, the gloo
        # group) can block for good once a peer has gone (seen in forked workers), and a rank that does
        # not exit holds its slot until the node manager kills it.
        stream_out.flush()
        exit_now(code)
    return code


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
    """Build the trainer that a prepare line ``{"prepare": {"fixed": ..., "gpus": n}}`` names, the way a
    batch of that fixed part builds it before loading its checkpoint (``executor.new_trainer``), while
    the worker waits for its spec; only when the trainer class says its ``init`` may run ahead
    (``Trainer.prepare_ahead``), else the module is just imported. None, logged, when that fails: the
    batch then builds its own and reports the error as its own."""
    try:
        hint = json.loads(line)["prepare"]
        fixed = FixedPart.from_json(hint["fixed"])
        gpus = int(hint.get("gpus", 0))
        trainer_cls = load_trainer_class(fixed.trainer)  # imported ahead in any case
        if not trainer_cls.prepare_ahead:
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
    for key in unset:
        os.environ.pop(key, None)
    os.environ.update(env)
    events_fd = os.dup(events.fileno())
    events.close()
    spec_stream = None
    if spec_input is not None:
        spec_stream = os.fdopen(os.dup(spec_input.fileno()), "r", encoding="utf-8")
        spec_input.close()
    sys.exit(main([*argv, "--events-fd", str(events_fd)], spec_stream))


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
