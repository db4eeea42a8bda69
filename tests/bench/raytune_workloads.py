"""The workloads of ``tests.bench.vs_raytune`` and the pure logic around them (no torch, no ray).

* S1: 48 trials of 40 steps whose learning-rate schedule branches in three phases: steps 0-19 take one
  of 2 values, 20-29 one of 4 (under each of those), 30-39 one of 6 (under each of those), so
  2 * 4 * 6 = 48 trials, 48 * 40 = 1,920 trial-by-trial steps and 2*20 + 8*10 + 48*10 = 600 unique
  steps: merge rate 3.2.
* S2: an ASHA study (reduction 4, rungs at steps 4, 16 and 64) over a grid of warmup -> cosine /
  multistep / constant learning-rate schedules and a batch-size sequence. The ASHA decisions are taken
  once, live on stagetree, and then *replayed* on both systems (``replay_work``): each trial is trained
  to the last step ASHA took it to and evaluated at every step ASHA asked for, so both systems do the
  same work.

``unique_steps`` counts the steps a prefix-sharing system must train (a step of two trials is the same
work exactly when their canonical segments agree up to it), ``merge_rate`` divides the trial-by-trial
steps by it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stagetree.client.spaces import GridSearchSpace
from stagetree.core.config import Config
from stagetree.core.sequences import Constant, Cosine, MultiStep, Piecewise, Sequence, Warmup

# a user's module (tests/bench/userstyle/digits_user.py): the digits MLP behind the imports users' modules have
TRAINER = "digits_user:DigitsNet"
DATASET = "sklearn-digits"
SEED = 0
TUNED = ("bs", "lr", "momentum")

# S1
S1_STEPS = 40
S1_PHASES = (20, 30)  # phase boundaries
S1_PHASE1 = (0.1, 0.05)
S1_PHASE2_FACTORS = (0.8, 0.5, 0.3, 0.15)  # of the phase-1 value
S1_PHASE3_FACTORS = (0.9, 0.7, 0.5, 0.35, 0.2, 0.1)  # of the phase-2 value

# S2
S2_ETA = 4
S2_MIN_STEP = 4
S2_MAX_STEP = 64
S2_WARMUP = 4
S2_PEAKS = (0.1, 0.05)


TrialConfig = dict[str, Sequence]


def s1_configs() -> list[TrialConfig]:
    """The 48 S1 trials in tree order (phase-1 choice slowest)."""
    out: list[TrialConfig] = []
    for a in S1_PHASE1:
        for f2 in S1_PHASE2_FACTORS:
            b = round(a * f2, 10)
            for f3 in S1_PHASE3_FACTORS:
                c = round(b * f3, 10)
                lr = Piecewise([Constant(a), Constant(b), Constant(c)], list(S1_PHASES))
                out.append({"bs": Constant(32), "lr": lr, "momentum": Constant(0.9)})
    return out


def s2_space() -> GridSearchSpace:
    """64 configurations: 16 learning-rate schedules (2 peaks x 8 shapes after a 4-step warmup) x 4
    batch-size sequences. Trials with the same peak share the warmup; multistep and constant shapes
    of one peak share until the first milestone; batch-size ramps share until they double."""
    lr: list[Sequence] = []
    for peak in S2_PEAKS:
        shapes: list[Sequence] = [
            Constant(peak),
            MultiStep(peak, [8], 0.3),
            MultiStep(peak, [20], 0.3),
            MultiStep(peak, [36], 0.3),
            MultiStep(peak, [20, 40], 0.3),
            MultiStep(peak, [36, 50], 0.2),
            Cosine(peak, 0.001, 60),
            Cosine(peak, 0.001, 30),
        ]
        lr.extend(Warmup(0.01, S2_WARMUP, s) for s in shapes)
    bs: list[Any] = [Constant(32), MultiStep(32, [8], 2), MultiStep(32, [24], 2), MultiStep(32, [40], 2)]
    return GridSearchSpace({"bs": bs, "lr": lr, "momentum": [0.9]})


def s2_asha_params() -> dict[str, Any]:
    """Keyword arguments of ``ASHA`` for S2 (all trials may be outstanding: the platform schedules)."""
    n = s2_space().size()
    return {
        "metric": "loss",
        "mode": "min",
        "eta": S2_ETA,
        "min_step": S2_MIN_STEP,
        "max_step": S2_MAX_STEP,
        "max_concurrent": n,
    }


# ---------------------------------------------------------------------------------------------
# Work and sharing


@dataclass(frozen=True)
class TrialWork:
    """One trial as a trial-by-trial system runs it: train from scratch to ``stop``, evaluate at ``evals``."""

    trial_id: int
    config: Mapping[str, Sequence]
    evals: tuple[int, ...]  # ascending; the last one is ``stop``

    @property
    def stop(self) -> int:
        return self.evals[-1]

    def config_json(self) -> dict[str, Any]:
        """The canonical segment form (``Config.from_json`` reads it back): what a Ray trial receives."""
        return Config.of(self.config).to_json()


def s1_work() -> list[TrialWork]:
    return [TrialWork(i, c, (S1_STEPS,)) for i, c in enumerate(s1_configs())]


def replay_work(submits: Iterable[Any]) -> list[TrialWork]:
    """The work of a tuner's run (its ``Submit`` actions, in order: ``trial_id``, ``config``, ``step``),
    one ``TrialWork`` per trial, ordered by trial id: every step it was submitted to, in order."""
    configs: dict[int, Mapping[str, Sequence]] = {}
    steps: dict[int, set[int]] = {}
    for sub in submits:
        configs.setdefault(sub.trial_id, dict(sub.config))
        steps.setdefault(sub.trial_id, set()).add(int(sub.step))
    return [TrialWork(t, configs[t], tuple(sorted(steps[t]))) for t in sorted(configs)]


def _prefix_keys(config: Config, stop: int) -> list[tuple[Any, ...]]:
    """What identifies the training of each step below ``stop`` (the step from ``s`` to ``s + 1``): the
    values of every hyper-parameter at steps ``0..s``. The stage tree branches where values differ, not
    where the schedules' segments do (a warmup into a cosine and into a multistep agree on the first step
    after the warmup, and that step is shared)."""
    keys: list[tuple[Any, ...]] = []
    prefix: tuple[Any, ...] = ()
    for s in range(stop):
        prefix = (prefix, tuple(sorted(config.values_at(s).items())))
        keys.append(prefix)
    return keys


def unique_steps(work: Iterable[TrialWork]) -> int:
    """Steps a system that shares common prefixes trains: each distinct (prefix, step) once."""
    seen: set[tuple[int, tuple[Any, ...]]] = set()
    for w in work:
        seen.update(enumerate(_prefix_keys(Config.of(w.config), w.stop)))
    return len(seen)


def trial_steps(work: Iterable[TrialWork]) -> int:
    """Steps a trial-by-trial system trains: each trial from scratch to its last eval."""
    return sum(w.stop for w in work)


def merge_rate(work: Iterable[TrialWork]) -> float:
    items = list(work)
    return trial_steps(items) / unique_steps(items)


def max_abs_diff(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """The largest difference over the metrics of ``a`` (inf when ``b`` lacks one)."""
    if not a:
        return float("inf")
    return max(abs(float(v) - float(b[k])) if k in b else float("inf") for k, v in a.items())
