"""What sharing bought a study: steps executed against the steps a trial-by-trial system would run, and
where the time of the work went.

Pure: the store reads the rows, this counts. Definitions (the same in the SDK, REST, CLI and gRPC):

- ``steps_executed``: training steps of every ended attempt of the batches that carried the study's
  requests, whatever its end: all of a batch's steps when it ran to its end, else the steps up to the
  furthest one its worker reported (a lost, preempted or failed attempt's steps count, also those a later
  batch resumed from its checkpoint); steps another study of the same scope trained for it are not
  counted: sharing saved them;
- ``unique_steps``: steps of the plan tree the study's answered points need, each shared prefix once;
- ``trial_by_trial_steps``: what a system that trains each trial from scratch to its last evaluated
  step would run (a trial is a request label; an unlabelled request is its own trial);
- ``merge_rate`` = trial-by-trial / unique; ``saved_steps`` = trial-by-trial - executed, and the
  seconds they would have cost at the study's measured seconds per executed step;
- ``compute_seconds``: the same attempts' training, from the worker's first step to its last (and the
  evaluations between), as the worker measured it; ``queue_seconds``: from each dispatch until a worker
  was handed the batch (a batch waits for its slot); ``startup_seconds``: the worker's start before it
  could train (process, imports, the trainer's init); ``checkpoint_seconds``: checkpoint I/O that held
  training up (restores, saves waited for). An attempt whose worker did not report its time (an older
  node manager) counts from its worker's start to its end as compute; one lost with its node manager
  counts its steps but no compute seconds (nobody saw when it stopped).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stagetree.core.lifecycle import AttemptTiming, BatchState


@dataclass(frozen=True)
class SharingStats:
    requests: Mapping[str, int]  # by state
    steps_executed: int
    unique_steps: int
    trial_by_trial_steps: int
    compute_seconds: float  # training time of the attempts that executed those steps
    queue_seconds: float = 0.0  # their batches waiting, from dispatch until a worker was handed them
    startup_seconds: float = 0.0  # their workers starting before they could train
    checkpoint_seconds: float = 0.0  # checkpoint I/O that held their training up

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
            "queue_seconds": round(self.queue_seconds, 3),
            "startup_seconds": round(self.startup_seconds, 3),
            "checkpoint_seconds": round(self.checkpoint_seconds, 3),
        }


@dataclass(frozen=True)
class EndedAttempt:
    """An ended batch attempt as the stats see it: its batch's steps (from ``start``, ``steps`` of them),
    how it ended, the furthest step its worker reported, and its times (the master's dispatch, the node
    manager's word of its worker's start, its end) with its worker's own measure when reported."""

    state: BatchState
    start: int
    steps: int
    reached: int | None
    dispatched_at: float
    started_at: float | None
    finished_at: float
    timing: AttemptTiming | None = None

    @property
    def trained(self) -> int:
        """Steps it trained: all of them when it ran to its end, else up to the furthest step reported."""
        if self.state is BatchState.DONE:
            return self.steps
        if self.reached is None:
            return 0
        return min(self.steps, max(0, self.reached - self.start))


@dataclass(frozen=True)
class WorkTotals:
    """Steps and seconds of a set of ended attempts (``work_of``)."""

    steps: int = 0
    compute_seconds: float = 0.0
    queue_seconds: float = 0.0
    startup_seconds: float = 0.0
    checkpoint_seconds: float = 0.0


def work_of(attempts: Iterable[EndedAttempt]) -> WorkTotals:
    """Sum of what the attempts trained and where their time went (see the module's definitions). A
    difference of two clocks (the master's and a node manager's) that comes out negative counts 0."""
    steps = 0
    compute = queue = startup = ckpt = 0.0
    for a in attempts:
        steps += a.trained
        t = a.timing
        if t is not None:
            queue += max(0.0, t.given_at - a.dispatched_at)
            startup += max(0.0, t.startup_s)
            ckpt += max(0.0, t.checkpoint_s)
            compute += max(0.0, t.train_s)
            continue
        began = a.started_at if a.started_at is not None else a.finished_at
        queue += max(0.0, began - a.dispatched_at)
        if a.started_at is not None and a.state is not BatchState.LOST:
            compute += max(0.0, a.finished_at - a.started_at)
    return WorkTotals(steps, compute, queue, startup, ckpt)


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
