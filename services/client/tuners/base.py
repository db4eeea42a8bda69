"""The tuner protocol: events in, actions out (like Determined's searcher).

This module owns the events a driver feeds a tuner, the actions a tuner answers with, and ``Tuner``, the
base every tuner derives from. A tuner is a pure state machine: it never sleeps, never does I/O and never
sees a clock, so it is unit-tested in milliseconds and driven unchanged by the simulator
(``simulate.py``) and by the asyncio driver against the server.

Events in:
    ``Start()``                                the study begins (``tuner.start()``)
    ``Result(trial_id, step, metrics)``        the outstanding ``Submit`` of a trial reached ``step``
    ``Failed(trial_id, error)``                the outstanding ``Submit`` of a trial failed; the trial is dead
Actions out:
    ``Submit(trial_id, config, step)``         train the trial up to ``step`` and report metrics there;
                                               extending a trial is a new Submit, same id and config
    ``Stop(trial_id)``                         cancel the trial's outstanding work
    ``Finish()``                               the tuner is done; emitted once, when nothing is outstanding

A trial has at most one outstanding ``Submit``. Every event a driver can send answers an outstanding
``Submit``, so a tuner with nothing outstanding that submits nothing new finishes: the base class emits
``Finish`` then, and subclasses never do. A driver is therefore a thin loop::

    actions = tuner.start()
    while not tuner.finished:
        carry out actions (Submit -> schedule, Stop -> cancel)
        actions = tuner.handle(await next completion)   # a Result or a Failed

A ``Result`` or ``Failed`` for a trial whose work was stopped is stale and ignored (it can race a Stop), and
so is a ``Result`` delivered twice; any other event that answers no outstanding ``Submit`` is an error.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeAlias

from stagetree.client.spaces import SearchSpace, TrialConfig
from stagetree.core.errors import FailedPrecondition, InvalidArgument

Mode: TypeAlias = Literal["max", "min"]
TrialStatus: TypeAlias = Literal["running", "paused", "done", "stopped", "failed"]


@dataclass(frozen=True)
class Start:
    """The study begins."""


@dataclass(frozen=True)
class Result:
    """Trial ``trial_id`` reached ``step``; ``metrics`` were measured there."""

    trial_id: int
    step: int
    metrics: Mapping[str, float]


@dataclass(frozen=True)
class Failed:
    """The outstanding work of trial ``trial_id`` failed with ``error``."""

    trial_id: int
    error: str = ""


Event: TypeAlias = Start | Result | Failed


@dataclass(frozen=True)
class Submit:
    """Train trial ``trial_id`` (hyper-parameters ``config``) up to ``step`` and report metrics there."""

    trial_id: int
    config: TrialConfig
    step: int


@dataclass(frozen=True)
class Stop:
    """Cancel the outstanding work of trial ``trial_id``."""

    trial_id: int


@dataclass(frozen=True)
class Finish:
    """The tuner is done."""


Action: TypeAlias = Submit | Stop | Finish


@dataclass
class Trial:
    """What a tuner knows about one of its trials."""

    trial_id: int
    config: TrialConfig
    results: dict[int, dict[str, float]] = field(default_factory=dict)
    pending: int | None = None
    status: TrialStatus = "paused"
    error: str | None = None
    parent: int | None = None

    def last_step(self) -> int | None:
        return max(self.results) if self.results else None


class Best(NamedTuple):
    trial_id: int
    step: int
    value: float
    config: TrialConfig


def check_mode(mode: object) -> Mode:
    if mode == "max":
        return "max"
    if mode == "min":
        return "min"
    raise InvalidArgument(f"mode: must be 'max' or 'min', got {mode!r}")


def score(value: float, mode: Mode) -> float:
    """Higher is better, whatever the mode; NaN is the worst."""
    if math.isnan(value):
        return -math.inf
    return value if mode == "max" else -value


def check_int(owner: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{owner}: {name}: must be an int, got {value!r}")
    if value < minimum:
        raise InvalidArgument(f"{owner}: {name}: must be >= {minimum}, got {value}")
    return value


class ConfigSource:
    """Draws configurations 0, 1, 2, ... from a space; ``wrap`` cycles a finite space instead of ending."""

    def __init__(self, space: SearchSpace, *, wrap: bool = False) -> None:
        if not callable(getattr(space, "config", None)) or not callable(getattr(space, "size", None)):
            raise InvalidArgument(f"space: must be a GridSearchSpace or RandomSearchSpace, got {space!r}")
        self.space = space
        self.size = space.size()
        self.wrap = wrap
        self.drawn = 0

    def exhausted(self) -> bool:
        return self.size is not None and not self.wrap and self.drawn >= self.size

    def next(self) -> TrialConfig:
        if self.exhausted():
            raise InvalidArgument(f"space: all {self.size} configurations were drawn")
        i = self.drawn if self.size is None or not self.wrap else self.drawn % self.size
        self.drawn += 1
        return self.space.config(i)


def trial_budget(owner: str, source: ConfigSource, n: int | None, name: str = "n_trials") -> int:
    """``n`` checked against the space; a finite space gives the default."""
    if n is None:
        if source.size is None:
            raise InvalidArgument(f"{owner}: {name}: is required with a random (unbounded) search space")
        return source.size
    check_int(owner, name, n, 1)
    if source.size is not None and not source.wrap and n > source.size:
        raise InvalidArgument(f"{owner}: {name}: {n} is more than the {source.size} configurations of the space")
    return n


class Tuner(ABC):
    """Base of every tuner: validates events, keeps per-trial records, emits ``Finish``.

    Subclasses implement ``_on_start``, ``_on_result`` and ``_on_failure`` with the helpers
    ``_new_trial``, ``_submit``, ``_stop`` and ``_rank``.
    """

    def __init__(self, metric: str, mode: str = "max") -> None:
        if not isinstance(metric, str) or not metric:
            raise InvalidArgument(f"metric: must be a non-empty metric name, got {metric!r}")
        self.metric = metric
        self.mode: Mode = check_mode(mode)
        self.trials: dict[int, Trial] = {}
        self._started = False
        self._finished = False

    # -- the protocol --------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._finished

    def start(self) -> list[Action]:
        if self._started:
            raise FailedPrecondition(f"{type(self).__name__}: start() was already called; create a new tuner")
        self._started = True
        return self._finalize(self._on_start())

    def on_result(self, result: Result) -> list[Action]:
        trial = self._event_trial(result.trial_id)
        if trial is None or (trial.pending is None and result.step in trial.results):
            return []  # stale, or delivered twice
        if trial.pending != result.step:
            raise InvalidArgument(
                f"result for trial {trial.trial_id} at step {result.step}: its outstanding Submit is "
                f"for step {trial.pending}"
            )
        metrics: dict[str, float] = {}
        for name, v in dict(result.metrics).items():
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise InvalidArgument(f"result for trial {trial.trial_id}: metric {name!r}: must be a number")
            metrics[name] = float(v)
        if self.metric not in metrics:
            raise InvalidArgument(
                f"result for trial {trial.trial_id} at step {result.step} has no metric {self.metric!r} "
                f"(it has {sorted(metrics)}); report it from evaluate()"
            )
        trial.results[result.step] = metrics
        trial.pending = None
        trial.status = "paused"
        return self._finalize(self._on_result(trial, result.step))

    def on_failure(self, failed: Failed) -> list[Action]:
        trial = self._event_trial(failed.trial_id)
        if trial is None:
            return []
        if trial.pending is None:
            raise InvalidArgument(f"failure for trial {trial.trial_id}: it has no outstanding Submit")
        trial.pending = None
        trial.status = "failed"
        trial.error = failed.error
        return self._finalize(self._on_failure(trial))

    def handle(self, event: Event) -> list[Action]:
        if isinstance(event, Start):
            return self.start()
        if isinstance(event, Result):
            return self.on_result(event)
        if isinstance(event, Failed):
            return self.on_failure(event)
        raise InvalidArgument(f"unknown event {event!r}")

    def close(self) -> list[Action]:
        """Give up early: stop every outstanding trial and finish."""
        if self._finished:
            return []
        actions: list[Action] = []
        for t in self.trials.values():
            actions.extend(self._stop(t))
        self._finished = True
        actions.append(Finish())
        return actions

    def pending(self) -> dict[int, int]:
        """Outstanding work: trial id -> the step it was submitted to."""
        return {t.trial_id: t.pending for t in self.trials.values() if t.pending is not None}

    def best(self, metric: str | None = None, mode: str | None = None, *, scope: str = "last") -> Best | None:
        """The best trial by ``metric`` (the tuner's by default). ``scope="last"`` compares each trial's
        latest result carrying the metric; ``scope="all"`` compares every reported result."""
        metric = self.metric if metric is None else metric
        m = self.mode if mode is None else check_mode(mode)
        if scope not in ("last", "all"):
            raise InvalidArgument(f"best: scope: must be 'last' or 'all', got {scope!r}")
        found: Best | None = None
        key: tuple[float, int, int] | None = None
        for t in self.trials.values():
            steps = sorted((s for s, ms in t.results.items() if metric in ms), reverse=True)
            for s in steps if scope == "all" else steps[:1]:
                v = t.results[s][metric]
                k = (score(v, m), s, -t.trial_id)
                if key is None or k > key:
                    key, found = k, Best(t.trial_id, s, v, t.config)
        return found

    # -- helpers for subclasses ----------------------------------------------------------------

    def _score_at(self, trial_id: int, step: int) -> float:
        return score(self.trials[trial_id].results[step][self.metric], self.mode)

    def _rank(self, trial_ids: Iterable[int], step: int) -> list[int]:
        """Trials with a result at ``step``, best first; ties go to the lower trial id."""
        have = [t for t in trial_ids if step in self.trials[t].results]
        return sorted(have, key=lambda t: (-self._score_at(t, step), t))

    def _new_trial(self, config: TrialConfig, parent: int | None = None) -> Trial:
        trial = Trial(len(self.trials), config, parent=parent)
        self.trials[trial.trial_id] = trial
        return trial

    def _submit(self, trial: Trial, step: int) -> Submit:
        if trial.pending is not None:
            raise AssertionError(f"trial {trial.trial_id} already has work outstanding (step {trial.pending})")
        trial.pending = step
        trial.status = "running"
        return Submit(trial.trial_id, trial.config, step)

    def _stop(self, trial: Trial, status: TrialStatus = "stopped") -> list[Action]:
        """Retire a trial; a Stop action only where there is outstanding work to cancel."""
        had_work = trial.pending is not None
        trial.pending = None
        if trial.status != "failed":
            trial.status = status
        return [Stop(trial.trial_id)] if had_work else []

    def _event_trial(self, trial_id: int) -> Trial | None:
        if not self._started:
            raise FailedPrecondition(f"{type(self).__name__}: call start() before feeding events")
        trial = self.trials.get(trial_id)
        if trial is None:
            raise InvalidArgument(f"event for unknown trial {trial_id}; known trials are 0..{len(self.trials) - 1}")
        if trial.pending is None and trial.status in ("stopped", "failed", "done"):
            return None  # stale: raced a Stop, or a duplicate report of dead work
        if self._finished:
            return None
        return trial

    def _finalize(self, actions: list[Action]) -> list[Action]:
        if not self._finished and not any(t.pending is not None for t in self.trials.values()):
            self._finished = True
            actions.append(Finish())
        return actions

    # -- the algorithm -------------------------------------------------------------------------

    @abstractmethod
    def _on_start(self) -> list[Action]: ...

    @abstractmethod
    def _on_result(self, trial: Trial, step: int) -> list[Action]: ...

    @abstractmethod
    def _on_failure(self, trial: Trial) -> list[Action]: ...
