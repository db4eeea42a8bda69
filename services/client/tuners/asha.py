"""ASHA: asynchronous successive halving, exactly Li et al., MLSys 2020, Algorithm 2.

This module owns ``ASHA``. With minimum resource r = ``min_step``, maximum R = ``max_step``, reduction
factor eta and minimum early-stopping rate s, rung k (k = 0 .. k_max, k_max = floor(log_eta(R/r)) - s)
is at step ``r * eta**(s + k)``. Rung k holds the trials that *completed* there, with their metric.

Whenever a worker is free (``max_concurrent`` outstanding jobs at most), ``get_job()``:

    for k = k_max - 1, ..., 1, 0:
        candidates = top floor(|rung k| / eta) trials of rung k
        promotable = candidates not yet promoted from rung k
        if promotable: return (promotable[0], k + 1)       # the best unpromoted candidate
    return (a new configuration, 0)                         # grow the bottom rung

Here a new configuration is drawn only while fewer than ``max_trials`` were drawn (and a finite space
has some left); otherwise the worker stays idle until a completion frees up a promotion. Ties in the
metric go to the lower trial id; NaN ranks last. A failed job frees its worker and leaves its trial out
of the rung it was running to; a trial is never promoted twice from the same rung.

Driven this way (get_job() for every free slot after every event), at most one configuration is
promotable at any call: a completion adds one trial to one rung, which makes at most one new candidate,
and frees one slot that takes it. So the top-down scan order is kept as in the paper but cannot show in a
trace; ``tests/sim/asha_check.py`` verifies the rest against an independent re-implementation.
"""

from __future__ import annotations

from stagetree.client.spaces import SearchSpace
from stagetree.client.tuners.base import Action, ConfigSource, Trial, Tuner, check_int, trial_budget
from stagetree.core.errors import InvalidArgument


class ASHA(Tuner):
    """Asynchronous successive halving (Li et al., MLSys 2020): a trial is promoted from rung k to rung
    k + 1 (step ``min_step * eta**(early_stopping_rate + k + 1)``, up to ``max_step``) as soon as it is in
    the top ``1/eta`` of the trials that finished rung k; a free worker (``max_concurrent`` at most) takes a
    promotion first, else a new configuration, until ``max_trials`` were drawn (a finite space: all of
    them by default). Trials left at a lower rung are pruned; see the module doc for the algorithm."""

    def __init__(
        self,
        space: SearchSpace,
        *,
        metric: str,
        mode: str = "max",
        eta: int = 3,
        min_step: int = 1,
        max_step: int,
        early_stopping_rate: int = 0,
        max_concurrent: int,
        max_trials: int | None = None,
    ) -> None:
        super().__init__(metric, mode)
        check_int("ASHA", "min_step", min_step, 1)
        check_int("ASHA", "max_step", max_step, 1)
        check_int("ASHA", "eta", eta, 2)
        s = check_int("ASHA", "early_stopping_rate", early_stopping_rate, 0)
        j = 0  # floor(log_eta(R / r)), exactly, in integers
        while min_step * eta ** (j + 1) <= max_step:
            j += 1
        if max_step < min_step or j - s < 0:
            raise InvalidArgument(
                f"ASHA: need min_step * eta**early_stopping_rate <= max_step; got min_step={min_step}, "
                f"eta={eta}, early_stopping_rate={s}, max_step={max_step}"
            )
        self.eta = eta
        self.k_max = j - s
        self.steps = [min_step * eta ** (s + k) for k in range(self.k_max + 1)]
        self.max_concurrent = check_int("ASHA", "max_concurrent", max_concurrent, 1)
        self.source = ConfigSource(space)
        self.max_trials = trial_budget("ASHA", self.source, max_trials, "max_trials")
        self.rungs: list[dict[int, float]] = [{} for _ in self.steps]
        self.promoted: list[set[int]] = [set() for _ in self.steps]
        self.promotions: list[tuple[int, int]] = []  # (trial id, rung promoted to), in order

    def get_job(self) -> tuple[Trial, int] | None:
        """Algorithm 2's get_job(), with the trial budget; the caller submits what it returns."""
        for k in range(self.k_max - 1, -1, -1):
            rung = self.rungs[k]
            top = sorted(rung, key=lambda t: (-rung[t], t))[: len(rung) // self.eta]
            for t in top:
                if t not in self.promoted[k]:
                    self.promoted[k].add(t)
                    self.promotions.append((t, k + 1))
                    return self.trials[t], k + 1
        if len(self.trials) < self.max_trials and not self.source.exhausted():
            return self._new_trial(self.source.next()), 0
        return None

    def _fill(self) -> list[Action]:
        actions: list[Action] = []
        while len(self.pending()) < self.max_concurrent:
            job = self.get_job()
            if job is None:
                break
            trial, k = job
            actions.append(self._submit(trial, self.steps[k]))
        return actions

    def _on_start(self) -> list[Action]:
        return self._fill()

    def _on_result(self, trial: Trial, step: int) -> list[Action]:
        k = self.steps.index(step)
        self.rungs[k][trial.trial_id] = self._score_at(trial.trial_id, step)
        if k == self.k_max:
            trial.status = "done"
        return self._fill()

    def _on_failure(self, trial: Trial) -> list[Action]:
        return self._fill()
