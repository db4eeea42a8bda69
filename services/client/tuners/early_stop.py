"""TreeML's ``EarlyStopTuner`` (Fig. 5.3): early-stop trials at milestones of a schedule.

This module owns ``Schedule`` (milestones ``(step, n_trials)``) and ``EarlyStopTuner``.
``EarlyStopTuner(Schedule.from_milestones((5, 8), (10, 4)), space, "test_acc")`` trains 8 trials to
step 5, keeps the best 4 by ``test_acc`` and trains them to step 10.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetree.client.spaces import SearchSpace
from stagetree.client.tuners.base import ConfigSource, check_int, trial_budget
from stagetree.client.tuners.halving import SyncHalving
from stagetree.core.errors import InvalidArgument


@dataclass(frozen=True)
class Milestone:
    step: int
    n_trials: int


@dataclass(frozen=True)
class Schedule:
    """Milestones with increasing steps and non-increasing trial counts."""

    milestones: tuple[Milestone, ...]

    def __post_init__(self) -> None:
        if not self.milestones:
            raise InvalidArgument("Schedule: milestones: need at least one (step, n_trials)")
        for i, m in enumerate(self.milestones):
            check_int("Schedule", f"milestones[{i}].step", m.step, 1)
            check_int("Schedule", f"milestones[{i}].n_trials", m.n_trials, 1)
            if i and m.step <= self.milestones[i - 1].step:
                raise InvalidArgument(f"Schedule: milestones[{i}].step: must be increasing, got {m.step}")
            if i and m.n_trials > self.milestones[i - 1].n_trials:
                raise InvalidArgument(
                    f"Schedule: milestones[{i}].n_trials: cannot grow from "
                    f"{self.milestones[i - 1].n_trials} to {m.n_trials}"
                )

    @classmethod
    def from_milestones(cls, *milestones: tuple[int, int]) -> Schedule:
        """``Schedule.from_milestones((5, 8), (10, 4))``: 8 trials to step 5, the best 4 to step 10."""
        ms = []
        for i, m in enumerate(milestones):
            if not isinstance(m, tuple | list) or len(m) != 2:
                raise InvalidArgument(f"Schedule: milestones[{i}]: must be a (step, n_trials) pair, got {m!r}")
            ms.append(Milestone(m[0], m[1]))
        return cls(tuple(ms))


class EarlyStopTuner(SyncHalving):
    """Run the schedule's first milestone's trials; at each milestone keep the best for the next."""

    def __init__(self, schedule: Schedule, space: SearchSpace, metric: str, mode: str = "max") -> None:
        if not isinstance(schedule, Schedule):
            raise InvalidArgument(f"EarlyStopTuner: schedule: must be a Schedule, got {schedule!r}")
        source = ConfigSource(space)
        trial_budget("EarlyStopTuner", source, schedule.milestones[0].n_trials, "schedule's first n_trials")
        steps = [m.step for m in schedule.milestones]
        counts = [m.n_trials for m in schedule.milestones]
        super().__init__(source, [(steps, counts)], metric=metric, mode=mode)
        self.schedule = schedule
