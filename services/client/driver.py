"""The asyncio driver: runs a pure tuner (``stagetree.client.tuners``) against a live ``Study``.

This module owns ``drive(study, tuner)``, the thin loop of the tuner protocol with real I/O:

* ``Submit(trial, config, step)`` -> ``study.submit(config, step, label="trial-<id>")`` (a handle; no
  I/O at that moment);
* ``Stop(trial)`` -> ``study.cancel(handle)`` of the trial's outstanding eval, in the background;
* a finished eval -> ``Result(trial, step, metrics)``, or ``Failed(trial, error)`` when its work failed
  or someone else cancelled it.

Completions that arrive together are fed to the tuner one after the other without yielding to the
event loop, so the submits they cause go out in one batch. Any other error (the master unreachable
after retries, a config the master rejects) stops outstanding work and is raised: it is a bug or an
outage, not a trial's result.

The run is recorded like the simulator's (``simulate.Run``): the trace of every event with the actions
the tuner answered, and one ``Job`` per eval with wall-clock times, so the same checks (for instance
``asha_check.check_asha_trace``) apply to a live run.

PBT's exploit needs nothing special here: the tuner's new trial is ``Piecewise([source, perturbed], [t])``,
which the master places as a branch of the source's path at step t, trained from the source's
checkpoint there.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from stagetree.client.sdk import EvalCancelled, EvalFailed, EvalResult, Evaluation, Study
from stagetree.client.tuners.base import Action, Event, Failed, Result, Start, Stop, Submit, Tuner
from stagetree.client.tuners.simulate import Job, Run
from stagetree.core.errors import StagetreeError

log = logging.getLogger(__name__)


@dataclass
class _Outstanding:
    submit: Submit
    handle: Evaluation
    from_step: int
    started: float


def _complete(queue: asyncio.Queue[_Outstanding], out: _Outstanding, _handle: object) -> None:
    queue.put_nowait(out)


async def drive(
    study: Study,
    tuner: Tuner,
    *,
    on_event: Callable[[Event, list[Action]], None] | None = None,
    max_evals: int = 1_000_000,
) -> Run:
    """Run ``tuner`` to its ``Finish`` against ``study``; returns the trace and the evals run.

    ``on_event(event, actions)`` is called after each event (progress reporting); ``max_evals`` guards
    against a tuner that never finishes."""
    run = Run()
    t0 = time.monotonic()
    outstanding: dict[int, _Outstanding] = {}
    progress: dict[int, int] = {}
    completed: asyncio.Queue[_Outstanding] = asyncio.Queue()
    cancels: set[asyncio.Task[EvalResult | None]] = set()
    evals = 0

    def apply(event: Event, actions: list[Action]) -> None:
        nonlocal evals
        run.trace.append((event, actions))
        if on_event is not None:
            on_event(event, actions)
        for a in actions:
            if isinstance(a, Submit):
                evals += 1
                if evals > max_evals:
                    raise RuntimeError(f"drive: more than {max_evals} evals; is the tuner looping?")
                out = _Outstanding(
                    a,
                    study.submit(a.config, a.step, label=f"trial-{a.trial_id}"),
                    progress.get(a.trial_id, 0),
                    time.monotonic() - t0,
                )
                outstanding[a.trial_id] = out
                out.handle.add_done_callback(functools.partial(_complete, completed, out))
            elif isinstance(a, Stop):
                stopped = outstanding.pop(a.trial_id, None)
                if stopped is not None:
                    end = time.monotonic() - t0
                    run.jobs.append(_job(stopped, end, cancelled=True))
                    task = asyncio.ensure_future(study.cancel(stopped.handle))
                    cancels.add(task)
                    task.add_done_callback(_cancel_done(cancels))

    def event_of(out: _Outstanding) -> Event:
        outcome = out.handle.outcome()
        sub = out.submit
        if isinstance(outcome, EvalResult):
            return Result(sub.trial_id, sub.step, outcome.metrics)
        if isinstance(outcome, EvalFailed | EvalCancelled):
            return Failed(sub.trial_id, outcome.message)
        if isinstance(outcome, BaseException):
            raise outcome
        raise AssertionError(f"unexpected outcome {outcome!r}")

    try:
        apply(Start(), tuner.start())
        while not tuner.finished:
            if not outstanding:
                raise RuntimeError(f"drive: {type(tuner).__name__} has nothing outstanding but did not finish")
            out = await completed.get()
            while True:
                if outstanding.get(out.submit.trial_id) is out:  # else: stale, the trial was stopped
                    del outstanding[out.submit.trial_id]
                    event = event_of(out)
                    run.jobs.append(_job(out, time.monotonic() - t0))
                    if isinstance(event, Result):
                        progress[out.submit.trial_id] = out.submit.step
                    apply(event, tuner.handle(event))
                if completed.empty() or tuner.finished:
                    break
                out = completed.get_nowait()
    except BaseException:
        for o in outstanding.values():
            task = asyncio.ensure_future(study.cancel(o.handle))
            cancels.add(task)
            task.add_done_callback(_cancel_done(cancels))
        raise
    finally:
        if cancels:
            await asyncio.gather(*cancels, return_exceptions=True)
        run.makespan = time.monotonic() - t0
    return run


def _job(out: _Outstanding, end: float, *, cancelled: bool = False) -> Job:
    sub = out.submit
    return Job(sub.trial_id, sub.step, out.from_step, 0, out.started, end, cancelled=cancelled)


def _cancel_done(tasks: set[asyncio.Task[EvalResult | None]]) -> Callable[[asyncio.Task[EvalResult | None]], None]:
    def done(task: asyncio.Task[EvalResult | None]) -> None:
        tasks.discard(task)
        if not task.cancelled() and isinstance(task.exception(), StagetreeError):
            log.warning("cancelling a stopped trial's eval failed: %s", task.exception())

    return done
