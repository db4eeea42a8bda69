"""Population based training (Jaderberg et al. 2017), in synchronous generations.

This module owns ``PBT``. A population of ``population`` trials trains in generations of ``interval``
steps (the last generation ends at ``max_step``). When every member has reported at step t < max_step:

* exploit: the bottom ``ceil(quantile * N)`` ranked members (at most N // 2) and every failed member are
  replaced by new trials, each branched from a member of the top quantile chosen at random;
* explore: the new trial's config is, for each hyper-parameter, ``Piecewise([source_seq, perturbed], [t])``:
  exactly the source's sequence on [0, t), so it shares the source's prefix and continues from its
  checkpoint at t (in stagetree, a branch of the search plan, no copying of weights). ``perturbed`` is,
  with probability ``resample_probability`` and a ``RandomSearchSpace``, a fresh draw from the space
  (starting its own step 0 at t); otherwise a constant: the source's value at t times a factor drawn from
  ``perturb_factors`` (ints rounded; strings and bools kept).

Survivors and new trials are then submitted to the next generation's step. Random choices come from
``random.Random(seed)`` in a fixed order (ranked members, names sorted), so a run is reproducible.
"""

from __future__ import annotations

import math
import random

from stagetree.client.spaces import RandomSearchSpace, SearchSpace, TrialConfig
from stagetree.client.tuners.base import Action, ConfigSource, Trial, Tuner, trial_budget
from stagetree.client.tuners.median import checkpoints
from stagetree.core.errors import InvalidArgument
from stagetree.core.sequences import Constant, Piecewise, Sequence


class PBT(Tuner):
    """Population based training: ``population`` trials train in generations of ``interval`` steps up to
    ``max_step``; after each generation the bottom ``quantile`` copy a top member's schedule up to that step
    and continue from its checkpoint (a branch of the search plan) with perturbed hyper-parameters (each
    value times one of ``perturb_factors``, or, with ``resample_probability``, a fresh draw from a
    ``RandomSearchSpace``); ``seed`` makes a run reproducible. See the module doc."""

    def __init__(
        self,
        space: SearchSpace,
        *,
        metric: str,
        mode: str = "max",
        population: int,
        interval: int,
        max_step: int,
        quantile: float = 0.25,
        perturb_factors: tuple[float, ...] = (0.8, 1.2),
        resample_probability: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(metric, mode)
        self.source = ConfigSource(space)
        self.space = space
        self.population = trial_budget("PBT", self.source, population, "population")
        self.steps = checkpoints("PBT", interval, max_step)
        if isinstance(quantile, bool) or not isinstance(quantile, int | float) or not 0 < quantile <= 0.5:
            raise InvalidArgument(f"PBT: quantile: must be in (0, 0.5], got {quantile!r}")
        if not perturb_factors or any(
            isinstance(f, bool) or not isinstance(f, int | float) or not math.isfinite(f) or f <= 0
            for f in perturb_factors
        ):
            raise InvalidArgument(f"PBT: perturb_factors: must be positive numbers, got {perturb_factors!r}")
        if not isinstance(resample_probability, int | float) or not 0 <= resample_probability <= 1:
            raise InvalidArgument(f"PBT: resample_probability: must be in [0, 1], got {resample_probability!r}")
        if resample_probability > 0 and not isinstance(space, RandomSearchSpace):
            raise InvalidArgument("PBT: resample_probability > 0 needs a RandomSearchSpace to resample from")
        self.quantile = float(quantile)
        self.perturb_factors = tuple(float(f) for f in perturb_factors)
        self.resample_probability = float(resample_probability)
        self.rng = random.Random(seed)
        self.members: list[int] = []
        self.generation = 0
        self.waiting: set[int] = set()
        self.exploits: list[tuple[int, int, int]] = []  # (new trial, source trial, step)

    def _on_start(self) -> list[Action]:
        actions: list[Action] = []
        for _ in range(self.population):
            trial = self._new_trial(self.source.next())
            self.members.append(trial.trial_id)
            actions.append(self._submit(trial, self.steps[0]))
        self.waiting = set(self.members)
        return actions

    def _on_result(self, trial: Trial, step: int) -> list[Action]:
        return self._reported(trial)

    def _on_failure(self, trial: Trial) -> list[Action]:
        return self._reported(trial)

    def _reported(self, trial: Trial) -> list[Action]:
        self.waiting.discard(trial.trial_id)
        return [] if self.waiting else self._next_generation()

    def _next_generation(self) -> list[Action]:
        t = self.steps[self.generation]
        ranked = self._rank(self.members, t)
        if t == self.steps[-1] or not ranked:
            for m in ranked:
                self.trials[m].status = "done"
            return []
        failed = [m for m in self.members if m not in ranked]
        n_q = min(math.ceil(self.quantile * len(self.members)), len(self.members) // 2)
        sources = ranked[: max(n_q, 1)]
        replaced = [m for m in ranked[len(ranked) - n_q :] if m not in sources] + failed
        survivors = [m for m in ranked if m not in replaced]
        self.generation += 1
        nxt = self.steps[self.generation]
        actions: list[Action] = [self._submit(self.trials[m], nxt) for m in survivors]
        members = list(survivors)
        for old in replaced:
            if self.trials[old].status != "failed":
                self.trials[old].status = "stopped"
            src = sources[self.rng.randrange(len(sources))]
            child = self._new_trial(self.explore(self.trials[src].config, t), parent=src)
            self.exploits.append((child.trial_id, src, t))
            members.append(child.trial_id)
            actions.append(self._submit(child, nxt))
        self.members = members
        self.waiting = set(members)
        return actions

    def explore(self, config: TrialConfig, step: int) -> TrialConfig:
        """The source's sequences on [0, step), perturbed ones from ``step`` on."""
        out: TrialConfig = {}
        for name in sorted(config):
            seq = config[name]
            perturbed: Sequence
            if self.resample_probability and self.rng.random() < self.resample_probability:
                assert isinstance(self.space, RandomSearchSpace)
                perturbed = self.space.sample_param(name, self.rng)
            else:
                v = seq.value(step)
                factor = self.perturb_factors[self.rng.randrange(len(self.perturb_factors))]
                if isinstance(v, (bool, str)):
                    perturbed = Constant(v)
                elif isinstance(v, int):
                    perturbed = Constant(round(v * factor))
                else:
                    perturbed = Constant(v * factor)
            out[name] = Piecewise([seq, perturbed], [step])
        return out
