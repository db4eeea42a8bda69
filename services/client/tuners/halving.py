"""Synchronous successive halving: SHA and Hyperband.

This module owns ``SyncHalving`` (brackets of explicit rungs, each rung a step and a number of trials
that run to it; a rung starts when every trial of the rung below has reported, and its trials are the
best of those), ``SHA`` (one bracket, Li et al. 2020 Algorithm 1) and ``Hyperband`` (Li et al., JMLR 2017:
brackets s = s_max .. 0 of SHA, run side by side). ``EarlyStopTuner`` (TreeML Fig. 5.3) builds on
``SyncHalving`` too.

Rungs are at ``min_step * eta**k`` for k = 0 .. K, with K = floor(log_eta(max_step / min_step)); trials
go no further than the top rung, ``min_step * eta**K <= max_step``. Rung k of a bracket of n trials keeps
floor(n / eta**k) of them (the paper's floor: a bracket can end before the top rung). A failed trial is
dropped from the ranking; when fewer trials than a rung keeps are left, all of them go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stagetree.client.spaces import SearchSpace
from stagetree.client.tuners.base import Action, ConfigSource, Trial, Tuner, check_int, trial_budget
from stagetree.core.errors import InvalidArgument


def rung_steps(owner: str, min_step: int, max_step: int, eta: int) -> list[int]:
    """``[min_step * eta**k for k in 0..K]``, the largest K with ``min_step * eta**K <= max_step``."""
    check_int(owner, "min_step", min_step, 1)
    check_int(owner, "max_step", max_step, 1)
    check_int(owner, "eta", eta, 2)
    if max_step < min_step:
        raise InvalidArgument(f"{owner}: max_step: must be >= min_step={min_step}, got {max_step}")
    steps = [min_step]
    while steps[-1] * eta <= max_step:
        steps.append(steps[-1] * eta)
    return steps


@dataclass
class Bracket:
    """One synchronous bracket: ``counts[k]`` trials run to ``steps[k]``."""

    steps: list[int]
    counts: list[int]
    rung: int = 0
    members: list[int] = field(default_factory=list)
    waiting: set[int] = field(default_factory=set)
    done: bool = False


class SyncHalving(Tuner):
    """Brackets of synchronous rungs, all brackets started at once."""

    def __init__(
        self,
        source: ConfigSource,
        brackets: list[tuple[list[int], list[int]]],
        *,
        metric: str,
        mode: str = "max",
    ) -> None:
        super().__init__(metric, mode)
        self.source = source
        self.brackets = [Bracket(list(steps), list(counts)) for steps, counts in brackets]
        self.bracket_of: dict[int, int] = {}  # trial id -> index in brackets

    def _on_start(self) -> list[Action]:
        actions: list[Action] = []
        for i, b in enumerate(self.brackets):
            for _ in range(b.counts[0]):
                trial = self._new_trial(self.source.next())
                self.bracket_of[trial.trial_id] = i
                b.members.append(trial.trial_id)
                b.waiting.add(trial.trial_id)
                actions.append(self._submit(trial, b.steps[0]))
        return actions

    def _on_result(self, trial: Trial, step: int) -> list[Action]:
        return self._reported(trial)

    def _on_failure(self, trial: Trial) -> list[Action]:
        return self._reported(trial)

    def _reported(self, trial: Trial) -> list[Action]:
        b = self.brackets[self.bracket_of[trial.trial_id]]
        b.waiting.discard(trial.trial_id)
        return [] if b.waiting else self._advance(b)

    def _advance(self, b: Bracket) -> list[Action]:
        ranked = self._rank(b.members, b.steps[b.rung])
        last = b.rung + 1 >= len(b.steps) or b.counts[b.rung + 1] == 0
        keep = [] if last else ranked[: b.counts[b.rung + 1]]
        for t in b.members:
            if t not in keep and self.trials[t].status != "failed":
                self.trials[t].status = "done" if last else "stopped"
        if not keep:
            b.done = True
            return []
        b.rung += 1
        b.members = keep
        b.waiting = set(keep)
        return [self._submit(self.trials[t], b.steps[b.rung]) for t in keep]


class SHA(SyncHalving):
    """Successive halving: ``n_trials`` at ``min_step``, the best 1/eta of each rung go on to the next."""

    def __init__(
        self,
        space: SearchSpace,
        *,
        metric: str,
        mode: str = "max",
        n_trials: int | None = None,
        eta: int = 3,
        min_step: int = 1,
        max_step: int,
    ) -> None:
        source = ConfigSource(space)
        n = trial_budget("SHA", source, n_trials)
        steps = rung_steps("SHA", min_step, max_step, eta)
        counts = [n // eta**k for k in range(len(steps))]
        super().__init__(source, [(steps, counts)], metric=metric, mode=mode)
        self.eta = eta


class Hyperband(SyncHalving):
    """Hyperband: bracket s (s = s_max .. 0) runs SHA on ceil((s_max+1) eta^s / (s+1)) trials from rung
    s_max - s; with max_step = min_step * eta**s_max this is Li et al.'s R = eta**s_max, r_s = R eta**-s.

    Brackets run side by side. A finite space is cycled through, bracket after bracket: the same
    configuration in two brackets is two trials, whose shared prefix stagetree trains once.
    """

    def __init__(
        self,
        space: SearchSpace,
        *,
        metric: str,
        mode: str = "max",
        eta: int = 3,
        min_step: int = 1,
        max_step: int,
    ) -> None:
        source = ConfigSource(space, wrap=True)
        steps = rung_steps("Hyperband", min_step, max_step, eta)
        s_max = len(steps) - 1
        brackets = []
        for s in range(s_max, -1, -1):
            n = -(-(s_max + 1) * eta**s // (s + 1))
            brackets.append((steps[s_max - s :], [n // eta**i for i in range(s + 1)]))
        super().__init__(source, brackets, metric=metric, mode=mode)
        self.eta = eta
