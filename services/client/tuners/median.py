"""Median stopping (Golovin et al., "Google Vizier", KDD 2017).

This module owns ``MedianStopping``. Trials are trained in increments of ``interval`` steps up to
``max_step``, reporting at each. At a report at step s >= ``grace_period``, a trial is stopped when its
best value so far (steps <= s) is strictly worse than the median, over the *other* trials that reached
step s, of their running averages (the mean of their values at steps <= s). Fewer than ``min_trials``
such trials: no decision, the trial goes on. A stopped or finished trial frees its place for a new one
until ``n_trials`` were drawn; at most ``max_concurrent`` trials run at once (``None``: all of them).
"""

from __future__ import annotations

import statistics

from stagetree.client.spaces import SearchSpace
from stagetree.client.tuners.base import Action, ConfigSource, Trial, Tuner, check_int, score, trial_budget


def checkpoints(owner: str, interval: int, max_step: int) -> list[int]:
    """``interval, 2*interval, ...`` up to ``max_step``, which is always the last one."""
    check_int(owner, "interval", interval, 1)
    check_int(owner, "max_step", max_step, 1)
    steps = list(range(interval, max_step, interval))
    return [*steps, max_step]


class MedianStopping(Tuner):
    """Median stopping (Vizier): trials train in increments of ``interval`` steps up to ``max_step``; from
    ``grace_period`` on, a trial whose best value so far is worse than the median of the other trials'
    running averages at that step (when ``min_trials`` reached it) is stopped, and its place goes to a
    new trial until ``n_trials`` were drawn; ``max_concurrent`` trials at once (all by default)."""

    def __init__(
        self,
        space: SearchSpace,
        *,
        metric: str,
        mode: str = "max",
        max_step: int,
        interval: int,
        n_trials: int | None = None,
        grace_period: int = 0,
        min_trials: int = 3,
        max_concurrent: int | None = None,
    ) -> None:
        super().__init__(metric, mode)
        self.steps = checkpoints("MedianStopping", interval, max_step)
        self.source = ConfigSource(space)
        self.n_trials = trial_budget("MedianStopping", self.source, n_trials)
        self.grace_period = check_int("MedianStopping", "grace_period", grace_period, 0)
        self.min_trials = check_int("MedianStopping", "min_trials", min_trials, 1)
        self.max_concurrent = self.n_trials
        if max_concurrent is not None:
            self.max_concurrent = check_int("MedianStopping", "max_concurrent", max_concurrent, 1)

    def should_stop(self, trial: Trial, step: int) -> bool:
        """The median stopping rule for ``trial``'s report at ``step``."""
        if step < self.grace_period:
            return False
        mine = [score(ms[self.metric], self.mode) for s, ms in trial.results.items() if s <= step]
        averages = []
        for other in self.trials.values():
            last = other.last_step()
            if other is trial or last is None or last < step:
                continue
            seen = [score(ms[self.metric], self.mode) for s, ms in other.results.items() if s <= step]
            averages.append(sum(seen) / len(seen))
        if len(averages) < self.min_trials:
            return False
        return max(mine) < statistics.median(averages)

    def _fill(self) -> list[Action]:
        actions: list[Action] = []
        while len(self.trials) < self.n_trials and len(self.pending()) < self.max_concurrent:
            actions.append(self._submit(self._new_trial(self.source.next()), self.steps[0]))
        return actions

    def _on_start(self) -> list[Action]:
        return self._fill()

    def _on_result(self, trial: Trial, step: int) -> list[Action]:
        if step == self.steps[-1]:
            trial.status = "done"
        elif self.should_stop(trial, step):
            trial.status = "stopped"
        else:
            return [self._submit(trial, self.steps[self.steps.index(step) + 1])]
        return self._fill()

    def _on_failure(self, trial: Trial) -> list[Action]:
        return self._fill()
