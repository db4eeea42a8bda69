"""Drivers that carry out a tuner's actions without a server: for tests, simulation and benchmarks.

This module owns ``run_sync`` (one job at a time, first submitted first run) and ``simulate`` (an
event-ordered simulation of N parallel workers where a job's duration is the steps it trains times a
per-step duration, so asynchronous tuners such as ASHA see results out of submission order). Both call
``evaluate(config, step) -> metrics`` for each job; an exception from it becomes a ``Failed`` event. Both
return a ``Run``: the trace (every event with the actions the tuner answered) and the jobs run.

A trial resumes from the last step it reached (its checkpoint); the simulator does not model stagetree's
sharing of prefixes between trials, so it measures the tuner, not the search plan.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

from stagetree.client.spaces import TrialConfig
from stagetree.client.tuners.base import Action, Event, Failed, Finish, Result, Start, Stop, Submit, Tuner
from stagetree.core.errors import InvalidArgument

Evaluate: TypeAlias = Callable[[TrialConfig, int], Mapping[str, float]]
StepTime: TypeAlias = float | Callable[[int, TrialConfig], float]
TraceEntry: TypeAlias = tuple[Event, list[Action]]


@dataclass(frozen=True)
class Job:
    """One Submit as it ran: trial ``trial_id`` trained from ``from_step`` to ``step`` on ``worker``."""

    trial_id: int
    step: int
    from_step: int
    worker: int
    start: float
    end: float
    cancelled: bool = False


@dataclass
class Run:
    trace: list[TraceEntry] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    makespan: float = 0.0
    interrupted: bool = False  # a live run stopped by Ctrl-C before the tuner finished (``drive``)

    def submits(self) -> list[Submit]:
        return [a for _, actions in self.trace for a in actions if isinstance(a, Submit)]

    def events(self) -> list[Event]:
        return [e for e, _ in self.trace]


def _run_job(evaluate: Evaluate, sub: Submit) -> Event:
    try:
        metrics = evaluate(sub.config, sub.step)
    except Exception as e:  # the user's training failed: the tuner decides what that means
        return Failed(sub.trial_id, f"{type(e).__name__}: {e}")
    return Result(sub.trial_id, sub.step, dict(metrics))


def _step_time(step_time: StepTime, sub: Submit) -> float:
    t = step_time(sub.trial_id, sub.config) if callable(step_time) else step_time
    if not t >= 0:
        raise InvalidArgument(f"step_time: must be >= 0, got {t!r} for trial {sub.trial_id}")
    return float(t)


def run_sync(tuner: Tuner, evaluate: Evaluate, *, max_jobs: int = 1_000_000) -> Run:
    """Drive ``tuner`` to completion, one job at a time in submission order."""
    run = Run()
    queue: deque[Submit] = deque()
    progress: dict[int, int] = {}

    def apply(event: Event, actions: list[Action]) -> None:
        run.trace.append((event, actions))
        for a in actions:
            if isinstance(a, Submit):
                queue.append(a)
            elif isinstance(a, Stop):
                for sub in [s for s in queue if s.trial_id == a.trial_id]:
                    queue.remove(sub)

    apply(Start(), tuner.start())
    while queue:
        if len(run.jobs) >= max_jobs:
            raise RuntimeError(f"run_sync: more than {max_jobs} jobs; is the tuner looping?")
        sub = queue.popleft()
        start = run.makespan
        frm = progress.get(sub.trial_id, 0)
        run.makespan += max(sub.step - frm, 0)
        run.jobs.append(Job(sub.trial_id, sub.step, frm, 0, start, run.makespan))
        event = _run_job(evaluate, sub)
        if isinstance(event, Result):
            progress[sub.trial_id] = sub.step
        apply(event, tuner.handle(event))
    if not tuner.finished:
        raise RuntimeError(f"run_sync: {type(tuner).__name__} has nothing to run but did not finish")
    return run


def simulate(
    tuner: Tuner,
    evaluate: Evaluate,
    *,
    workers: int,
    step_time: StepTime = 1.0,
    max_jobs: int = 1_000_000,
) -> Run:
    """Drive ``tuner`` with ``workers`` parallel workers in simulated time.

    Queued jobs start in submission order on the lowest-numbered free worker; completions are processed
    in time order (ties in start order), one event at a time. ``Stop`` drops a trial's queued job and
    cancels its running one.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgument(f"simulate: workers: must be an int >= 1, got {workers!r}")
    run = Run()
    queue: deque[Submit] = deque()
    running: dict[int, tuple[Submit, int, float, float, int]] = {}  # worker -> (job, from, start, end, seq)
    heap: list[tuple[float, int, int]] = []
    progress: dict[int, int] = {}
    now = 0.0
    seq = 0

    def apply(event: Event, actions: list[Action]) -> None:
        run.trace.append((event, actions))
        for a in actions:
            if isinstance(a, Submit):
                queue.append(a)
            elif isinstance(a, Stop):
                for sub in [s for s in queue if s.trial_id == a.trial_id]:
                    queue.remove(sub)
                for w, (sub, frm, start, _, _) in list(running.items()):
                    if sub.trial_id == a.trial_id:
                        del running[w]
                        run.jobs.append(Job(sub.trial_id, sub.step, frm, w, start, now, cancelled=True))

    def dispatch() -> None:
        nonlocal seq
        for w in range(workers):
            if not queue:
                return
            if w in running:
                continue
            sub = queue.popleft()
            frm = progress.get(sub.trial_id, 0)
            end = now + max(sub.step - frm, 0) * _step_time(step_time, sub)
            running[w] = (sub, frm, now, end, seq)
            heapq.heappush(heap, (end, seq, w))
            seq += 1

    apply(Start(), tuner.start())
    dispatch()
    while heap:
        end, s, w = heapq.heappop(heap)
        if w not in running or running[w][4] != s:
            continue  # cancelled by a Stop
        if len(run.jobs) >= max_jobs:
            raise RuntimeError(f"simulate: more than {max_jobs} jobs; is the tuner looping?")
        now = end
        sub, frm, start, _, _ = running.pop(w)
        run.jobs.append(Job(sub.trial_id, sub.step, frm, w, start, end))
        event = _run_job(evaluate, sub)
        if isinstance(event, Result):
            progress[sub.trial_id] = sub.step
        apply(event, tuner.handle(event))
        dispatch()
    run.makespan = now
    if not tuner.finished:
        raise RuntimeError(f"simulate: {type(tuner).__name__} has nothing to run but did not finish")
    return run


def finished_in(run: Run) -> bool:
    """Whether the trace ends with exactly one ``Finish``."""
    finishes = [a for _, actions in run.trace for a in actions if isinstance(a, Finish)]
    last = run.trace[-1][1] if run.trace else []
    return len(finishes) == 1 and bool(last) and isinstance(last[-1], Finish)
