"""What sharing bought a study: steps executed against the steps a trial-by-trial system would run.

Pure: the store reads the rows, this counts. Definitions (the same in the SDK, REST, CLI and gRPC):

- ``steps_executed``: training steps of the finished batches that answered the study's requests
  (steps another study of the same scope trained for it are not counted: sharing saved them);
- ``unique_steps``: steps of the plan tree the study's answered points need, each shared prefix once;
- ``trial_by_trial_steps``: what a system that trains each trial from scratch to its last evaluated
  step would run (a trial is a request label; an unlabelled request is its own trial);
- ``merge_rate`` = trial-by-trial / unique; ``saved_steps`` = trial-by-trial - executed, and the
  seconds they would have cost at the study's measured seconds per executed step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SharingStats:
    requests: Mapping[str, int]  # by state
    steps_executed: int
    unique_steps: int
    trial_by_trial_steps: int
    compute_seconds: float  # of the finished attempts that executed those steps

    @property
    def merge_rate(self) -> float:
        return self.trial_by_trial_steps / self.unique_steps if self.unique_steps else 0.0

    @property
    def saved_steps(self) -> int:
        return max(0, self.trial_by_trial_steps - self.steps_executed)

    @property
    def saved_seconds(self) -> float:
        if not self.steps_executed:
            return 0.0
        return self.compute_seconds / self.steps_executed * self.saved_steps

    def to_json(self) -> dict[str, object]:
        return {
            "requests": dict(self.requests),
            "steps_executed": self.steps_executed,
            "unique_steps": self.unique_steps,
            "trial_by_trial_steps": self.trial_by_trial_steps,
            "merge_rate": round(self.merge_rate, 4),
            "saved_steps": self.saved_steps,
            "compute_seconds": round(self.compute_seconds, 3),
            "saved_seconds": round(self.saved_seconds, 3),
        }


def unique_steps(nodes: Mapping[int, tuple[int | None, int]], points: Iterable[tuple[int, int]]) -> int:
    """Steps of the tree (``node -> (parent, start)``) on the paths from a fresh model to ``points``
    (``(node, step)``), each step once."""
    reach: dict[int, int] = {}
    for node, step in points:
        while node is not None and step > reach.get(node, nodes[node][1]):
            reach[node] = step
            parent, start = nodes[node]
            node, step = parent, start  # type: ignore[assignment]
    return sum(r - nodes[n][1] for n, r in reach.items())


def trial_by_trial_steps(requests: Iterable[tuple[str, int]]) -> int:
    """Sum over trials of the last step each was evaluated at; ``(label, step)`` pairs, where an empty
    label stands for a trial of its own."""
    last: dict[str, int] = {}
    alone = 0
    for label, step in requests:
        if label:
            last[label] = max(last.get(label, 0), step)
        else:
            alone += step
    return alone + sum(last.values())
