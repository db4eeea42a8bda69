"""Running one stage batch in the current process: the loop between the user's trainer and the master.

``BatchRun`` initializes the trainer (or restores the source checkpoint), then trains the batch's
stages back to back. Before each step it evaluates the stage's hyper-parameter sequences and calls
``setup`` with the values that differ from those last applied (all of them at the first step after an
init or a restore, including across a stage boundary). After each step it evaluates at ``spec.evals``
points, saves *central* checkpoints at ``spec.saves`` points and *peripheral* ones every
``peripheral_every_steps`` steps or ``peripheral_every_s`` seconds, and checks for preemption (finish
the step, save, stop). What ``train`` returns (and what it ``log``-ged) is a learning-curve point,
kept every ``spec.curve_every_steps`` steps and, past its first ``CURVE_BURST`` points, at most
``spec.curve_max_per_s`` a second (``core.batch.CurveRate``; non-finite values dropped), buffered, and
emitted as ``curve`` events of one node: at most every ``CURVE_FLUSH_S``, at the end of each stage, and
before the batch ends, so none is lost to a finish. The text lines the trainer logged (``log_text``) are
emitted as ``log_line`` events after ``init``, after each step (its evaluations' included) and before the
batch ends, numbered within the attempt; past ``core.loglines.MAX_LINES`` the last line kept says how many
more were logged.
Checkpoints of trainers with ``state_dict`` are snapshotted in memory and written by a background
thread; a failed write fails the batch. With ``spec.snapshot_budget_bytes`` such a trainer (on one rank)
is also snapshotted in memory after every step that saves nothing (every k-th step when a snapshot of
every step would not fit the budget), and the snapshots are written as one pack when the batch ends or
is preempted, each of its points reported as a peripheral ``checkpoint_saved`` of the pack's uri: a
trial that arrives later and branches inside this batch's range resumes at its branch point.

Everything the master learns goes through ``emit(kind, payload)`` (see ``events.EVENT_FIELDS``). Just
ahead of its terminal event an attempt emits ``batch_timing``, where its time went (``_Times``): start-up
from when the worker was handed the batch (``given_at``) to when it could train, the trainer's init
included; checkpoint I/O that held training up (the restore, saves and the writes it waited for); and
training, steps and evaluations, less that I/O. A study's stats count training time from it alone.
A failure becomes ``batch_failed``: its ``error`` is what was raised and the last ``TRACEBACK_LINES``
lines of the traceback (the whole traceback goes to the worker's log). It is flagged ``user_error``
when the user's code raised (a frame of the trainer's own files is on the traceback, or a metric came
back NaN or infinite), which the master does not retry; an out-of-memory error is flagged ``oom`` so the
scheduler can retry with more resources.

On a batch of several ranks (``group``, see ``runtime.distributed``) every rank runs this loop in step:
rank 0 emits the events (the others emit only ``batch_failed``; ``checkpoint_saved`` says how many ranks
wrote a checkpoint, and ``rescaled`` that the batch resumed one written by another number of ranks),
evaluates and writes the checkpoints,
each of which holds every rank's RNG state (gathered, a collective); a preemption or a checkpoint due by
the clock is agreed on by all ranks (``RankGroup.start_sync`` after each step, whose result is taken a
step later, at once at a stage's end; it also averages the step metrics over the ranks), so they save
and stop at the same step. A collective that fails because
another rank went away is not the user's error.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import re
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from stagetree.core.batch import BatchSpec, CurveRate, Point
from stagetree.core.config import Config, FixedPart
from stagetree.core.loglines import MAX_LINES, cap_notice
from stagetree.core.sequences import Value
from stagetree.nodemanager.runtime.checkpoints import CheckpointStore, StoredCheckpoint
from stagetree.nodemanager.runtime.distributed import SINGLE_RANK, RankGroup, StepSync, is_peer_lost
from stagetree.nodemanager.runtime.events import Emit
from stagetree.nodemanager.runtime.ranks import PEER_LOST_NOTE
from stagetree.nodemanager.runtime.state import (
    Snapshot,
    restore_checkpoint,
    save_now,
    snapshot_bytes,
    take_snapshot,
    write_pack,
)
from stagetree.nodemanager.runtime.trainer import (
    Trainer,
    TrainerContext,
    capture_rng_state,
    restore_rng_state,
    seed_everything,
)

log = logging.getLogger(__name__)

CheckpointKind = Literal["central", "peripheral"]
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_.=-]")


@dataclass(frozen=True)
class BatchOutcome:
    status: Literal["finished", "preempted", "failed"]
    step: int  # the model's step when the batch stopped
    steps_trained: int
    uri: str | None = None  # the checkpoint a preempted batch resumes from
    error: str | None = None
    oom: bool = False
    user_error: bool = False


@dataclass
class _Times:
    """Where an attempt's time goes (monotonic seconds, but ``given_at``: epoch seconds)."""

    given_at: float  # when the worker was handed the batch
    before_run: float  # from then to the start of ``run`` (process start-up, imports, reading the spec)
    init: float = 0.0  # building the trainer (0 when it was built ahead)
    restore: float = 0.0  # loading the source checkpoint
    saves: float = 0.0  # saving checkpoints, and waiting for their writes
    train_from: float | None = None  # when training began (after the restore)
    saves_before: float = 0.0  # ``saves`` by then

    def payload(self, now: float) -> dict[str, float]:
        train = 0.0 if self.train_from is None else now - self.train_from - (self.saves - self.saves_before)
        return {
            "given_at": self.given_at,
            "startup_s": max(0.0, self.before_run + self.init),
            "checkpoint_s": max(0.0, self.restore + self.saves),
            "train_s": max(0.0, train),
        }


@dataclass
class _Save:
    future: Future[StoredCheckpoint]
    points: tuple[Point, ...]  # each at its own step (a pack's points are many steps)
    kind: CheckpointKind
    step: int
    pack: bool = False


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a CUDA or CPU out-of-memory error."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryError | torch.cuda.OutOfMemoryError):
            return True
        if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


TRACEBACK_LINES = 40
CURVE_FLUSH_S = 0.25  # a curve event at most this often per batch: one line per point costs a small model
CURVE_MAX_BUFFER = 1000  # points per curve event at most


class NonFiniteMetric(ValueError):
    """``evaluate()`` returned NaN or an infinity: the training diverged (the user's run, not ours)."""


def user_files(trainer_cls: type) -> tuple[str, ...]:
    """Where the user's code lives: the trainer's module file and, for a trainer in a package of its
    own, that package's directory (its helpers)."""
    module = sys.modules.get(trainer_cls.__module__)
    path = getattr(module, "__file__", None)
    if not path:
        return ()
    out = [os.path.abspath(path)]
    top = sys.modules.get(trainer_cls.__module__.split(".")[0])
    top_path = getattr(top, "__file__", None)
    if top is not module and top_path and not trainer_cls.__module__.startswith("stagetree."):
        out.append(os.path.dirname(os.path.abspath(top_path)) + os.sep)
    return tuple(out)


def raised_in_user_code(exc: BaseException, files: tuple[str, ...]) -> bool:
    """Whether ``exc`` came from the user's code: a retry would raise it again."""
    if isinstance(exc, NonFiniteMetric):
        return True
    if not files:
        return False
    return any(os.path.abspath(f.filename).startswith(files) for f in traceback.extract_tb(exc.__traceback__))


def error_text(exc: BaseException, tb: str) -> str:
    """What was raised, then the end of its traceback (where)."""
    lines = tb.rstrip().splitlines()
    tail = lines[-TRACEBACK_LINES:]
    cut = f"(traceback: its last {len(tail)} of {len(lines)} lines)\n" if len(lines) > len(tail) else ""
    return f"{type(exc).__name__}: {exc}\n{cut}" + "\n".join(tail)


def constant_until(config: Config, step: int) -> float:
    """The first step after ``step`` at which a value of ``config`` may differ from its value at
    ``step`` (``inf`` if none): the runtime evaluates the sequences only there."""
    until = math.inf
    for _name, segments in config.items:
        seg = segments[bisect.bisect_right(segments, step, key=lambda g: g.start) - 1]
        if seg.kind != "const":
            return step + 1
        if seg.end is not None:
            until = min(until, seg.end)
    return until


def finite_values(values: Any) -> dict[str, float]:
    """A step's metrics as ``{str: float}``, without NaN or infinities (a curve point cannot hold them;
    a diverged run shows where its curve stops). Values may be 0-d tensors."""
    out: dict[str, float] = {}
    for k, v in values.items():
        f = float(v)
        if math.isfinite(f):
            out[str(k)] = f
    return out


def _done_future(value: StoredCheckpoint) -> Future[StoredCheckpoint]:
    f: Future[StoredCheckpoint] = Future()
    f.set_result(value)
    return f


@dataclass(frozen=True)
class InMemory:
    """The trainer a finished batch left in this process, at its end ``point`` of plan ``plan_key``, and
    the process's RNG states as that batch ended: a batch of the same plan, fixed part and device kind
    that starts at that point continues from it (no ``init``, no checkpoint read), exactly as it would
    from the checkpoint saved there (the trainer's state is what ``state_dict`` would have written, the
    RNG states what ``runtime.pt`` holds)."""

    trainer: Trainer
    plan_key: str
    fixed: FixedPart
    point: Point
    gpus: int
    rng: dict[str, Any]

    @classmethod
    def after(cls, spec: BatchSpec, trainer: Trainer) -> InMemory:
        """What batch ``spec``, which finished with ``trainer``, leaves for the next batch."""
        return cls(trainer, spec.plan_key, spec.fixed, spec.end, spec.gpus, capture_rng_state())

    @property
    def on_gpu(self) -> bool:
        """Whether the trainer holds CUDA memory (its device, not the batch's ``gpus``: a CPU slot runs
        batches that ask for a GPU on the CPU)."""
        return getattr(self.trainer, "device", torch.device("cpu")).type == "cuda"

    def fits(self, spec: BatchSpec) -> bool:
        """Whether ``spec`` (on one rank) starts where this trainer stands. Its source checkpoint must exist
        (the batch says where it is): a batch the master starts from a fresh model builds one."""
        return (
            spec.source.uri is not None
            and spec.source.point == self.point
            and spec.plan_key == self.plan_key
            and spec.fixed == self.fixed
            and (spec.gpus > 0) == (self.gpus > 0)
            and spec.slots == 1
        )


def device_for(gpus: int) -> torch.device:
    """The device of a batch that asks for ``gpus`` GPUs: CUDA when it asks for any and has one."""
    return torch.device("cuda" if gpus > 0 and torch.cuda.is_available() else "cpu")


def new_trainer(
    factory: Callable[[], Trainer], fixed: FixedPart, device: torch.device, rank: int = 0, world_size: int = 1
) -> Trainer:
    """A trainer bound to its context, seeded and initialized: what every batch of ``fixed`` builds
    before it loads its checkpoint. On one rank it depends on nothing else, so a warm worker can build
    it before its batch arrives (``runtime.worker``'s prepare line); every rank is seeded alike."""
    trainer = factory()
    trainer.bind(TrainerContext(fixed=fixed.values, seed=fixed.seed, device=device, rank=rank, world_size=world_size))
    seed_everything(fixed.seed)
    trainer.init()
    return trainer


class BatchRun:
    """One attempt of one batch, ``run()`` on one thread; its saves and evaluations are the spec's."""

    def __init__(
        self,
        spec: BatchSpec,
        trainer_factory: Callable[[], Trainer],
        store: CheckpointStore,
        emit: Emit,
        should_preempt: Callable[[], bool] = lambda: False,
        *,
        device: torch.device | None = None,
        background_saves: bool = True,
        max_pending_saves: int = 2,
        progress_interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        prepared: Trainer | None = None,
        group: RankGroup = SINGLE_RANK,
        given_at: float | None = None,
        continued: InMemory | None = None,
    ) -> None:
        """``given_at``: when this worker was handed the batch (epoch seconds; None: when ``run`` starts),
        from which its start-up is counted."""
        self.spec = spec
        self._group = group
        self._factory = trainer_factory
        # the user's files: a traceback through them is the user's error (factories in tests are classes too)
        self._user_files = user_files(trainer_factory) if isinstance(trainer_factory, type) else ()
        self._store = store
        self._emit = emit if group.leader else _failures_only(emit)
        self._should_preempt = should_preempt
        self._device = device_for(spec.gpus) if device is None else device
        self._prepared = prepared  # new_trainer(trainer_factory, spec.fixed, device), built ahead
        self._continued = continued  # the trainer the batch before left at this batch's source (fits)
        self._background = background_saves
        self._max_pending = max(1, max_pending_saves)
        self._progress_interval = progress_interval_s
        self._clock = clock
        self._ids = {"batch_id": spec.batch_id, "attempt": spec.attempt}
        self._saves = set(spec.saves)
        self._evals = set(spec.evals)
        self._point_steps = {p.step for p in self._saves | self._evals}
        self._pending: deque[_Save] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._trainer: Trainer | None = None
        self._last_save: _Save | None = None
        self._last_ckpt_step = spec.start_step
        self._last_ckpt_time = 0.0
        self._last_save_step = -1  # on every rank (rank 0 alone keeps _last_save)
        self._curve: list[list[Any]] = []  # [[step, {name: value}], ...] of self._curve_node, not emitted yet
        self._curve_node = spec.stages[0].node
        self._curve_flushed = 0.0
        self._curve_rate = CurveRate(spec.curve_max_per_s)
        self._snaps: dict[Point, Snapshot] = {}  # in-memory snapshots of this batch's steps, packed at its end
        self._snap_stride = 0  # a snapshot every this many steps (0: not decided until the first one)
        self._given_at = given_at
        self._times = _Times(0.0, 0.0)
        self._lines = 0  # text lines the trainer logged in this attempt (emitted or not)
        self._last_line: dict[str, Any] | None = None  # the line of seq MAX_LINES - 1, held until the end

    @property
    def trainer(self) -> Trainer | None:
        """The batch's trainer once it is built (after ``run``: at the step the batch stopped)."""
        return self._trainer

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> BatchOutcome:
        spec = self.spec
        now = time.time()
        given = now if self._given_at is None else min(self._given_at, now)
        self._times = _Times(given, now - given)
        self._emit("batch_started", dict(self._ids))
        step = spec.start_step
        trained = 0
        try:
            with ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-b{spec.batch_id}") as pool:
                self._pool = pool
                trainer = self._start()
                self._times.train_from, self._times.saves_before = time.monotonic(), self._times.saves
                trainer.step = step
                applied = self._setup(trainer, spec.stages[0].config.values_at(step), {})
                self._handle_points(trainer, step, initial=True)
                self._take_lines(trainer, spec.stages[0].node, step)
                self._last_ckpt_step, self._last_ckpt_time = step, self._clock()
                last_progress = float("-inf")
                end = spec.end.step
                periodic = spec.peripheral_every_steps > 0 or spec.peripheral_every_s > 0
                # on a GPU a copy per step would wait for the device each step: CPU slots only
                snapshots = (
                    spec.snapshot_budget_bytes > 0
                    and self._device.type == "cpu"
                    and not self._group.distributed
                    and self._background
                    and type(trainer).snapshots_in_memory()
                )
                distributed = self._group.distributed
                pending_sync: StepSync | None = None
                for stage in spec.stages:
                    node = stage.node
                    self._flush_curve(node)
                    same_until: float = -1  # the stage's values at steps < this equal those last applied
                    for s in range(stage.start, stage.end):
                        if s >= same_until:
                            applied = self._setup(trainer, stage.config.values_at(s), applied)
                            same_until = constant_until(stage.config, s)
                        trainer.step = s
                        values = trainer.train()
                        step = s + 1
                        trained += 1
                        now = self._clock()
                        if trainer.logged:
                            values = {**trainer.logged, **values} if values else trainer.logged
                            trainer.logged = {}
                        if distributed:
                            # Every rank saves and stops at the same step, and the step metrics are averaged
                            # over the ranks: one all-reduce per step, started now and taken one step later
                            # (at a stage's last step, at once), so it runs while the next step trains.
                            every_s = spec.peripheral_every_s
                            timed = every_s > 0 and now - self._last_ckpt_time >= every_s
                            local = (_PERIODIC if timed else 0) | (_PREEMPT if self._should_preempt() else 0)
                            started = self._group.start_sync(local, values, step, now)
                            values = None  # recorded when its average comes back
                            ready = [] if pending_sync is None else [pending_sync]
                            pending_sync = None
                            if s == stage.end - 1:
                                ready.append(started)
                            else:
                                pending_sync = started
                            # by steps, every rank knows alike; by the clock, as agreed
                            every = spec.peripheral_every_steps
                            periodic_due = every > 0 and step - self._last_ckpt_step >= every
                            preempt_now = False
                            for sync in ready:
                                flags, averaged = sync.wait()
                                # a checkpoint asked for by the clock at a step is due unless one was saved since
                                periodic_due |= bool(flags & _PERIODIC) and self._last_save_step < sync.step
                                preempt_now |= bool(flags & _PREEMPT)
                                self._curve_point(sync.step, sync.at, averaged, node)
                        self._curve_point(step, now, values, node)  # distributed: None, taken from its sync
                        if self._progress_interval <= 0 or now - last_progress >= self._progress_interval:
                            self._emit("progress", {**self._ids, "node": node, "step": step})
                            last_progress = now
                        saved = step in self._point_steps and self._handle_points(trainer, step)
                        if trainer.logged_lines:
                            self._take_lines(trainer, node, step)
                        if not distributed:
                            periodic_due = periodic and self._peripheral_due(step, now)
                            preempt_now = False
                        if periodic_due and step < end and not saved:
                            self._save(trainer, (Point(node, step),), "peripheral", step)
                        if snapshots and step < end and self._last_save_step != step:
                            self._snapshot(trainer, Point(node, step))
                        if self._pending:
                            self._drain(block=False)
                        if step < end and (preempt_now or (not distributed and self._should_preempt())):
                            if pending_sync is not None:  # every rank has it in flight: take its curve point
                                _, averaged = pending_sync.wait()
                                self._curve_point(pending_sync.step, pending_sync.at, averaged, node)
                            self._flush_curve(node)
                            return self._preempt(trainer, node, step, trained)
                self._flush_curve(self._curve_node)
                self._write_pack()
                self._drain(block=True)
            self._take_lines(trainer, self._curve_node, step)  # a save's lines too
            self._end_lines()
            self._emit("batch_timing", {**self._ids, **self._times.payload(time.monotonic())})
            self._emit("batch_finished", {**self._ids, "steps": trained})
            return BatchOutcome("finished", step, trained)
        except Exception as e:
            return self._fail(e, step, trained)
        finally:
            self._pool = None

    def _curve_point(self, step: int, now: float, values: Any, node: int) -> None:
        """Keep ``values`` as the curve point of ``step`` (ended at ``now``) when the batch's curve rate
        says so."""
        every = self.spec.curve_every_steps
        if not values or not every or step % every or not self._curve_rate.take(now):
            return
        self._curve.append([step, finite_values(values)])
        if now - self._curve_flushed >= CURVE_FLUSH_S or len(self._curve) >= CURVE_MAX_BUFFER:
            self._flush_curve(node, now)

    def _flush_curve(self, node: int, now: float | None = None) -> None:
        """Emit the buffered curve points (of ``self._curve_node``); later points belong to ``node``."""
        if self._curve:
            points = [p for p in self._curve if p[1]]
            if points:
                self._emit("curve", {**self._ids, "node": self._curve_node, "points": points})
            self._curve.clear()
        self._curve_node = node
        self._curve_flushed = self._clock() if now is None else now

    def _take_lines(self, trainer: Trainer, node: int, step: int) -> None:
        """Emit the text lines ``trainer`` logged since this was last called, at (node, step): ``seq`` in
        the attempt's order, the line of the last ``seq`` held until the end (``_end_lines``)."""
        lines, trainer.logged_lines = trainer.logged_lines, []
        first = self._lines
        self._lines += len(lines) + trainer.lines_dropped
        trainer.lines_dropped = 0
        for seq, (at, line) in enumerate(lines[: max(0, MAX_LINES - first)], start=first):
            event = {**self._ids, "seq": seq, "node": node, "step": step, "at": at, "line": line}
            if seq < MAX_LINES - 1:
                self._emit("log_line", event)
            else:
                self._last_line = event

    def _end_lines(self) -> None:
        """Emit the held line of the last ``seq``: the trainer's own, or, when it logged more, how many
        more (every later line was dropped)."""
        if self._last_line is None:
            return
        event, self._last_line = self._last_line, None
        if self._lines > MAX_LINES:
            event["line"] = cap_notice(self._lines - (MAX_LINES - 1))
        self._emit("log_line", event)

    def _start(self) -> Trainer:
        spec = self.spec
        continued, self._continued = self._continued, None
        if continued is not None:
            self._trainer = continued.trainer
            continued.trainer.logged = {}
            continued.trainer.logged_lines, continued.trainer.lines_dropped = [], 0
            restore_rng_state(continued.rng)
            log.info(
                "batch continues from memory: the trainer the batch before left at step %d",
                spec.source.point.step,
                extra={**self._ids, "init_s": 0.0, "restore_s": 0.0, "from_memory": True},
            )
            return continued.trainer
        trainer, self._prepared = self._prepared, None
        info = self._group.info
        t0 = time.monotonic()
        built_ahead = trainer is not None
        if trainer is None:
            trainer = new_trainer(self._factory, spec.fixed, self._device, info.rank, info.world_size)
        self._trainer = trainer
        t_init = time.monotonic()
        if spec.source.uri is not None:
            at, ranks = restore_checkpoint(
                trainer, self._store, spec.source.uri, info.rank, info.world_size, spec.source.point
            )
            if ranks != info.world_size:  # the trainer is rescalable (restore refuses otherwise): say so
                self._emit(
                    "rescaled",
                    {
                        **self._ids,
                        "node": spec.source.point.node,
                        "step": spec.source.point.step,
                        "uri": spec.source.uri,
                        "from_ranks": ranks,
                        "to_ranks": info.world_size,
                    },
                )
            if at.step != spec.source.point.step:
                log.warning(
                    "source checkpoint is at step %d, the batch says %d",
                    at.step,
                    spec.source.point.step,
                    extra={"batch_id": spec.batch_id, "uri": spec.source.uri},
                )
        elif spec.source.point.step != 0:
            log.warning(
                "batch starts at step %d without a checkpoint: training from a fresh model",
                spec.source.point.step,
                extra={"batch_id": spec.batch_id},
            )
        now = time.monotonic()
        self._times.init, self._times.restore = t_init - t0, now - t_init
        log.info(
            "batch ready to train: init %.3f s%s, restore %.3f s",
            t_init - t0,
            " (built ahead)" if built_ahead else "",
            now - t_init,
            extra={**self._ids, "init_s": round(t_init - t0, 4), "restore_s": round(now - t_init, 4)},
        )
        return trainer

    @staticmethod
    def _setup(trainer: Trainer, values: dict[str, Value], applied: dict[str, Value]) -> dict[str, Value]:
        changes = {
            k: v for k, v in values.items() if k not in applied or applied[k] != v or type(applied[k]) is not type(v)
        }
        if changes:
            trainer.setup(dict(changes))
            applied = {**applied, **changes}
        return applied

    def _points_at(self, step: int, initial: bool = False) -> tuple[Point, ...]:
        pts = [Point(s.node, step) for s in self.spec.stages if s.start <= step <= s.end]
        if initial and self.spec.source.point not in pts:
            pts.insert(0, self.spec.source.point)
        return tuple(pts)

    def _handle_points(self, trainer: Trainer, step: int, *, initial: bool = False) -> bool:
        if step not in self._point_steps:
            return False
        candidates = self._points_at(step, initial)
        evals = tuple(p for p in candidates if p in self._evals)
        saves = tuple(p for p in candidates if p in self._saves)
        if initial and self.spec.source.uri is not None:
            saves = ()  # the source checkpoint already holds this point
        if saves:
            self._save(trainer, saves, "central", step)
        if evals and self._group.leader:
            rng = capture_rng_state()
            metrics = {str(k): float(v) for k, v in trainer.evaluate().items()}
            restore_rng_state(rng)  # evaluation must not shift the training trajectory
            bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
            if bad:
                shown = ", ".join(f"{k}={metrics[k]}" for k in bad)
                raise NonFiniteMetric(
                    f"evaluate() returned {shown} at step {step}: the training diverged (a learning rate too "
                    "high, or a loss that overflowed)"
                )
            for p in evals:
                self._emit("metrics", {**self._ids, "node": p.node, "step": step, "metrics": metrics})
        return bool(saves)

    def _peripheral_due(self, step: int, now: float) -> bool:
        spec = self.spec
        if spec.peripheral_every_steps > 0 and step - self._last_ckpt_step >= spec.peripheral_every_steps:
            return True
        return spec.peripheral_every_s > 0 and now - self._last_ckpt_time >= spec.peripheral_every_s

    # -- checkpoints ----------------------------------------------------------------------------

    def _key(self, node: int, step: int, kind: CheckpointKind) -> str:
        spec = self.spec
        plan = _KEY_UNSAFE.sub("_", spec.plan_key) or "plan"
        return f"{plan}/n{node}/s{step}-{kind}-b{spec.batch_id}a{spec.attempt}"

    def _save(self, trainer: Trainer, points: tuple[Point, ...], kind: CheckpointKind, step: int) -> None:
        t0 = time.monotonic()
        try:
            self._save_now(trainer, points, kind, step)
        finally:
            self._times.saves += time.monotonic() - t0

    def _save_now(self, trainer: Trainer, points: tuple[Point, ...], kind: CheckpointKind, step: int) -> None:
        point = Point(points[0].node, step)
        self._last_save_step = step
        rng_ranks = None
        if self._group.distributed:  # every rank's streams, gathered on rank 0, which alone writes
            rng_ranks = self._group.gather(capture_rng_state())
            if not self._group.leader:
                self._last_ckpt_step, self._last_ckpt_time = step, self._clock()
                return
        key = self._key(point.node, step, kind)
        assert self._pool is not None
        if self._background and type(trainer).snapshots_in_memory():
            snapshot = take_snapshot(trainer, point, rng_ranks)
            # Bound the snapshots held in memory: wait for the oldest write when too many are queued.
            while sum(not p.future.done() for p in self._pending) >= self._max_pending:
                next(p for p in self._pending if not p.future.done()).future.exception()
            future = self._pool.submit(self._store.put, key, snapshot.write)
        else:
            future = _done_future(self._store.put(key, lambda d: save_now(trainer, point, d, rng_ranks)))
        record = _Save(future, points, kind, step)
        self._pending.append(record)
        self._last_save = record
        self._last_ckpt_step, self._last_ckpt_time = step, self._clock()

    def _snapshot(self, trainer: Trainer, point: Point) -> None:
        """Keep the model at ``point`` in memory for the pack, within the batch's snapshot budget: every
        step's, or every k-th so that they fit; none when fewer than two would (not a small model)."""
        stride = self._snap_stride
        if stride < 0 or (stride and (point.step - self.spec.start_step) % stride):
            return
        t0 = time.monotonic()
        snap = take_snapshot(trainer, point)
        self._times.saves += time.monotonic() - t0  # a copy that holds training up, as a save does
        if not stride:
            need = snapshot_bytes(snap) * self.spec.steps
            stride = self._snap_stride = max(1, -(-need // self.spec.snapshot_budget_bytes))
            if 2 * stride > self.spec.steps:
                self._snap_stride = -1
                log.info("no snapshots: %d bytes a step exceed the batch's budget", need // self.spec.steps)
                return
            if stride > 1:
                log.info("snapshots every %d steps: each step's would take %d bytes", stride, need, extra=self._ids)
        self._snaps[point] = snap

    def _write_pack(self) -> None:
        """Write the in-memory snapshots as one pack (in the background; reported when drained)."""
        if not self._snaps:
            return
        snaps, self._snaps = self._snaps, {}
        first = next(iter(snaps))
        spec = self.spec
        plan = _KEY_UNSAFE.sub("_", spec.plan_key) or "plan"
        key = f"{plan}/n{first.node}/s{first.step}-pack-b{spec.batch_id}a{spec.attempt}"
        assert self._pool is not None
        future = self._pool.submit(self._store.put, key, lambda d: write_pack(snaps, d))
        self._pending.append(_Save(future, tuple(snaps), "peripheral", max(p.step for p in snaps), pack=True))

    def _drain(self, *, block: bool) -> None:
        """Emit ``checkpoint_saved`` for finished writes, in order; re-raise a failed write. A pack's
        points share its uri, each with its share of the bytes."""
        while self._pending and (block or self._pending[0].future.done()):
            record = self._pending.popleft()
            t0 = time.monotonic()
            try:
                stored = record.future.result()
            finally:
                self._times.saves += time.monotonic() - t0
            nbytes = stored.bytes // len(record.points) if record.pack else stored.bytes
            for p in record.points:
                self._emit(
                    "checkpoint_saved",
                    {
                        **self._ids,
                        "node": p.node,
                        "step": p.step,
                        "uri": stored.uri,
                        "bytes": nbytes,
                        "kind": record.kind,
                        "ranks": self._group.info.world_size,
                    },
                )

    def _preempt(self, trainer: Trainer, node: int, step: int, trained: int) -> BatchOutcome:
        if self._last_save_step != step:
            self._snaps.pop(Point(node, step), None)
            self._save(trainer, (Point(node, step),), "peripheral", step)
        self._write_pack()
        if not self._group.leader:
            return BatchOutcome("preempted", step, trained)
        record = self._last_save
        assert record is not None
        self._drain(block=True)
        uri = record.future.result().uri
        at = record.points[0].node
        ranks = self._group.info.world_size
        self._take_lines(trainer, node, step)
        self._end_lines()
        self._emit("batch_timing", {**self._ids, **self._times.payload(time.monotonic())})
        self._emit("batch_preempted", {**self._ids, "node": at, "step": step, "uri": uri, "ranks": ranks})
        log.info("batch preempted", extra={"batch_id": self.spec.batch_id, "step": step, "uri": uri})
        return BatchOutcome("preempted", step, trained, uri=uri)

    def _fail(self, exc: Exception, step: int, trained: int) -> BatchOutcome:
        tb = traceback.format_exc()
        try:  # the curve up to the failure is what shows why it failed
            self._flush_curve(self._curve_node)
        except Exception:
            log.exception("curve points lost while failing batch", extra={"batch_id": self.spec.batch_id})
        oom = is_oom(exc)
        peer_lost = self._group.distributed and is_peer_lost(exc)
        user = not oom and not peer_lost and raised_in_user_code(exc, self._user_files)
        try:  # checkpoints snapshotted before the failure are still good: report them
            self._drain(block=True)
        except Exception:
            log.exception("checkpoint write failed while failing batch", extra={"batch_id": self.spec.batch_id})
        self._pending.clear()
        if self._trainer is not None:  # what the trainer logged up to the failure shows why it failed
            self._take_lines(self._trainer, self._curve_node, step)
        self._end_lines()
        error = error_text(exc, tb)
        if peer_lost:
            error = f"{PEER_LOST_NOTE}: {error}"
        log.error(
            "batch failed at step %d: %s: %s\n%s",
            step,
            type(exc).__name__,
            exc,
            tb.rstrip(),
            extra={**self._ids, "step": step, "oom": oom, "user_error": user},
        )
        self._emit("batch_timing", {**self._ids, **self._times.payload(time.monotonic())})
        failed = {"error": error, "traceback": tb, "oom": oom, "user_error": user, "host_problem": False}
        self._emit("batch_failed", {**self._ids, **failed})
        return BatchOutcome("failed", step, trained, error=error, oom=oom, user_error=user)


_PERIODIC = 1  # RankGroup.step_sync bits
_PREEMPT = 2
_RANK_EVENTS = frozenset({"batch_failed"})  # what a rank other than 0 reports


def _failures_only(emit: Emit) -> Emit:
    def emit_failure(kind: str, payload: dict[str, Any]) -> None:
        if kind in _RANK_EVENTS:
            emit(kind, payload)

    return emit_failure


def run_batch(
    spec: BatchSpec,
    trainer_factory: Callable[[], Trainer],
    store: CheckpointStore,
    emit: Emit,
    should_preempt: Callable[[], bool] = lambda: False,
    **options: Any,
) -> BatchOutcome:
    """Run one batch to its end, a preemption, or a failure (see ``BatchRun`` for ``options``)."""
    return BatchRun(spec, trainer_factory, store, emit, should_preempt, **options).run()
