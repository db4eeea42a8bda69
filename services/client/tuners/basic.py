"""Grid and random search: every trial is trained to ``max_step``, no early stopping.

This module owns ``GridTuner`` (every configuration of a finite space) and ``RandomTuner`` (``n_trials``
configurations of any space). ``max_concurrent`` bounds the outstanding trials; ``None`` submits them all
at once, which suits stagetree best: the search plan sees every trial and shares their common prefixes.
"""

from __future__ import annotations

from stagetree.client.spaces import SearchSpace
from stagetree.client.tuners.base import Action, ConfigSource, Trial, Tuner, check_int, trial_budget
from stagetree.core.errors import InvalidArgument


class RandomTuner(Tuner):
    """Train ``n_trials`` configurations drawn from ``space`` to ``max_step``."""

    def __init__(
        self,
        space: SearchSpace,
        *,
        metric: str,
        mode: str = "max",
        max_step: int,
        n_trials: int | None = None,
        max_concurrent: int | None = None,
    ) -> None:
        super().__init__(metric, mode)
        owner = type(self).__name__
        self.source = ConfigSource(space)
        self.n_trials = trial_budget(owner, self.source, n_trials)
        self.max_step = check_int(owner, "max_step", max_step, 1)
        self.max_concurrent = None if max_concurrent is None else check_int(owner, "max_concurrent", max_concurrent, 1)

    def _fill(self) -> list[Action]:
        actions: list[Action] = []
        limit = self.n_trials if self.max_concurrent is None else self.max_concurrent
        while len(self.trials) < self.n_trials and len(self.pending()) < limit:
            actions.append(self._submit(self._new_trial(self.source.next()), self.max_step))
        return actions

    def _on_start(self) -> list[Action]:
        return self._fill()

    def _on_result(self, trial: Trial, step: int) -> list[Action]:
        trial.status = "done"
        return self._fill()

    def _on_failure(self, trial: Trial) -> list[Action]:
        return self._fill()


class GridTuner(RandomTuner):
    """Train every configuration of a finite space (a ``GridSearchSpace``) to ``max_step``."""

    def __init__(
        self,
        space: SearchSpace,
        *,
        metric: str,
        mode: str = "max",
        max_step: int,
        max_concurrent: int | None = None,
    ) -> None:
        if ConfigSource(space).size is None:
            raise InvalidArgument("GridTuner: space: must be finite (a GridSearchSpace); use RandomTuner")
        super().__init__(space, metric=metric, mode=mode, max_step=max_step, max_concurrent=max_concurrent)
