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
``tests/sim/asha_check.py``) apply to a live run.

PBT's exploit needs nothing special here: the tuner's new trial is ``Piecewise([source, perturbed], [t])``,
which the master places as a branch of the source's path at step t, trained from the source's
checkpoint there.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stagetree.client.progress import LiveProgress, watching
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


def _complete(queue: asyncio.Queue[_Outstanding | None], out: _Outstanding, _handle: object) -> None:
    queue.put_nowait(out)


async def drive(
    study: Study,
    tuner: Tuner,
    *,
    on_event: Callable[[Event, list[Action]], None] | None = None,
    max_evals: int = 1_000_000,
    progress: bool | None = None,
    stop: asyncio.Event | None = None,
) -> Run:
    """Run ``tuner`` to its ``Finish`` against ``study``; returns the trace and the evals run.

    ``on_event(event, actions)`` is called after each event; ``max_evals`` guards against a tuner that
    never finishes. ``progress`` draws the run's progress (trials running, done, pruned and failed, the
    best so far, steps executed against trial by trial; ``client.progress``): by default where a person
    watches (a terminal or a notebook), never when ``False``. Each failed trial is shown once with the
    end of its traceback and its log path (logged as a warning when progress is off).

    Ctrl-C (in the main thread) stops the run cleanly: the tuner is closed, the outstanding evals are
    cancelled on the master, one line says what was cancelled and how to resume, and ``drive`` returns
    the run so far (``Run.interrupted``). A second Ctrl-C interrupts as Python would. Setting ``stop``
    does the same from elsewhere (another thread's interrupt: ``client.tune``)."""
    run = Run()
    t0 = time.monotonic()
    outstanding: dict[int, _Outstanding] = {}
    progress_of: dict[int, int] = {}
    completed: asyncio.Queue[_Outstanding | None] = asyncio.Queue()  # None: Ctrl-C
    cancels: set[asyncio.Task[EvalResult | None]] = set()
    evals = 0
    view = LiveProgress(study.name, tuner, enabled=watching() if progress is None else bool(progress))
    poller = asyncio.ensure_future(_poll_stats(study, view)) if view.enabled else None

    def cancel(handle: Evaluation) -> None:
        task = asyncio.ensure_future(study.cancel(handle))
        cancels.add(task)
        task.add_done_callback(_cancel_done(cancels))

    def apply(event: Event, actions: list[Action]) -> None:
        run.trace.append((event, actions))
        if on_event is not None:
            on_event(event, actions)
        carry_out(actions)

    def carry_out(actions: list[Action]) -> None:
        nonlocal evals
        for a in actions:
            if isinstance(a, Submit):
                evals += 1
                if evals > max_evals:
                    raise RuntimeError(f"drive: more than {max_evals} evals; is the tuner looping?")
                out = _Outstanding(
                    a,
                    study.submit(a.config, a.step, label=f"trial-{a.trial_id}"),
                    progress_of.get(a.trial_id, 0),
                    time.monotonic() - t0,
                )
                outstanding[a.trial_id] = out
                out.handle.add_done_callback(functools.partial(_complete, completed, out))
            elif isinstance(a, Stop):
                stopped = outstanding.pop(a.trial_id, None)
                if stopped is not None:
                    run.jobs.append(_job(stopped, time.monotonic() - t0, cancelled=True))
                    cancel(stopped.handle)
        view.update()

    def event_of(out: _Outstanding) -> Event:
        outcome = out.handle.outcome()
        sub = out.submit
        if isinstance(outcome, EvalResult):
            return Result(sub.trial_id, sub.step, outcome.metrics)
        if isinstance(outcome, EvalFailed | EvalCancelled):
            if isinstance(outcome, EvalFailed):
                view.failed(sub.trial_id, outcome.message)
            return Failed(sub.trial_id, outcome.message)
        if isinstance(outcome, BaseException):
            raise outcome
        raise AssertionError(f"unexpected outcome {outcome!r}")

    goodbye = ""  # the line that ends a run stopped by Ctrl-C
    stop_catching = _catch_sigint(lambda: completed.put_nowait(None))
    stopper = asyncio.ensure_future(_put_none_when(stop, completed)) if stop is not None else None
    try:
        apply(Start(), tuner.start())
        while not tuner.finished:
            if not outstanding:
                raise RuntimeError(f"drive: {type(tuner).__name__} has nothing outstanding but did not finish")
            got = await completed.get()
            while True:
                if got is None:  # Ctrl-C: a second one is Python's again
                    stop_catching()
                    n = len(outstanding)
                    carry_out(tuner.close())
                    run.interrupted = True
                    goodbye = _interrupted_line(study, n, sum(1 for j in run.jobs if not j.cancelled))
                    break
                out = got
                if outstanding.get(out.submit.trial_id) is out:  # else: stale, the trial was stopped
                    del outstanding[out.submit.trial_id]
                    event = event_of(out)
                    run.jobs.append(_job(out, time.monotonic() - t0))
                    if isinstance(event, Result):
                        progress_of[out.submit.trial_id] = out.submit.step
                    apply(event, tuner.handle(event))
                if completed.empty() or tuner.finished:
                    break
                got = completed.get_nowait()
            if run.interrupted:
                break
    except BaseException:
        for o in outstanding.values():
            cancel(o.handle)
        raise
    finally:
        stop_catching()
        if stopper is not None:
            stopper.cancel()
        if cancels:
            await asyncio.gather(*cancels, return_exceptions=True)
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
            await _poll_stats(study, view, once=True)
        view.close()
        if goodbye:
            view.write(goodbye, always=True)  # last, under the bar's final state
        run.makespan = time.monotonic() - t0
    return run


async def _put_none_when(event: asyncio.Event, queue: asyncio.Queue[_Outstanding | None]) -> None:
    await event.wait()
    queue.put_nowait(None)


def _interrupted_line(study: Study, cancelled: int, finished: int) -> str:
    return (
        f"stopped by Ctrl-C: cancelled {cancelled} running evaluation(s) of study {study.name!r}; its "
        f"{finished} finished result(s) are kept. To resume, run the same study again (e.g. your script): "
        "what finished is answered from the search plan, not trained again"
    )


async def _poll_stats(study: Study, view: LiveProgress, *, every_s: float = 2.0, once: bool = False) -> None:
    """Keep the progress view's steps executed vs trial by trial current (from the study's stats)."""
    while True:
        try:
            st = await asyncio.wait_for(study.stats(), timeout=5.0)
            view.set_steps(st.steps_executed, st.trial_by_trial_steps)
        except Exception as e:  # a view must never end the run it shows
            log.debug("progress: no stats: %s", e)
        if once:
            return
        await asyncio.sleep(every_s)


_SIGINT_LISTENERS: list[Callable[[], None]] = []
_SIGINT_PREVIOUS: Any = None


def _catch_sigint(callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback`` on Ctrl-C (in the main thread's loop; elsewhere nothing is caught); returns the
    function that stops catching it, which gives SIGINT back to whoever had it (asyncio.run's handler)."""
    global _SIGINT_PREVIOUS
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    if not _SIGINT_LISTENERS:
        previous = signal.getsignal(signal.SIGINT)
        try:
            loop.add_signal_handler(signal.SIGINT, lambda: [fn() for fn in list(_SIGINT_LISTENERS)])
        except (NotImplementedError, RuntimeError, ValueError):  # not a Unix loop, or a loop of another thread
            return lambda: None
        _SIGINT_PREVIOUS = previous
    _SIGINT_LISTENERS.append(callback)

    def stop() -> None:
        if callback not in _SIGINT_LISTENERS:
            return
        _SIGINT_LISTENERS.remove(callback)
        if not _SIGINT_LISTENERS:
            loop.remove_signal_handler(signal.SIGINT)
            signal.signal(
                signal.SIGINT, _SIGINT_PREVIOUS if _SIGINT_PREVIOUS is not None else signal.default_int_handler
            )

    return stop


def _job(out: _Outstanding, end: float, *, cancelled: bool = False) -> Job:
    sub = out.submit
    return Job(sub.trial_id, sub.step, out.from_step, 0, out.started, end, cancelled=cancelled)


def _cancel_done(tasks: set[asyncio.Task[EvalResult | None]]) -> Callable[[asyncio.Task[EvalResult | None]], None]:
    def done(task: asyncio.Task[EvalResult | None]) -> None:
        tasks.discard(task)
        if not task.cancelled() and isinstance(task.exception(), StagetreeError):
            log.warning("cancelling a stopped trial's eval failed: %s", task.exception())

    return done
