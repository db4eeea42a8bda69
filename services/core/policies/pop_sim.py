"""A trace-driven simulator of HyperDrive (§7.1) to compare search policies on time-to-target.

A *trace* is one configuration's metric after every epoch and its epoch duration. ``S`` machines run
one trial each; each finished epoch is an ``OnIterationFinish`` up-call to the policy, which answers
continue, suspend (the slot is busy ``suspend_s`` more, then free; the trial keeps its progress and waits
idle) or terminate. A free slot asks the policy which idle trial runs next (``AllocateJobs``); resuming
a suspended trial costs ``resume_s`` before its next epoch starts. The result is the time at which any
trial first reports the target metric.

``cifar_like_traces`` generates workloads shaped like HyperDrive's CIFAR-10 study (Fig. 1, 2c): 100
random configurations of at most 120 epochs of about a minute each, a third of them never leaving the
10% of random guessing, most of the rest plateauing well below the target, a handful reaching it, and
curves that cross (slow starters overtaking fast ones).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.pop import IdleJob, SearchPolicy, Verdict


@dataclass(frozen=True)
class Trace:
    id: str
    epoch_s: float
    values: tuple[float, ...]  # the metric after epochs 1..len(values)

    @property
    def max_epochs(self) -> int:
        return len(self.values)


def cifar_like_traces(
    n: int = 100,
    max_epochs: int = 120,
    seed: int = 0,
    non_learning: float = 0.32,
    noise: float = 0.01,
) -> list[Trace]:
    """Validation-accuracy traces. Non-learners stay near 0.10 (random guessing on 10 classes). Learners
    follow the usual two-phase CNN curve, a fast rise over the first epochs then a slow creep:
    ``0.1 + (F - 0.1) (1 - w exp(-e / tau1) - (1 - w) exp(-e / tau2))`` towards a final accuracy ``F``
    whose distribution puts a few percent of all configurations above 0.77; a small ``w`` with a high
    ``F`` is a slow starter that overtakes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        epoch_s = rng.uniform(40.0, 90.0)
        if rng.random() < non_learning:
            vals = [0.1 + rng.gauss(0.0, noise) for _ in range(max_epochs)]
        else:
            final = 0.12 + 0.70 * rng.betavariate(1.6, 1.4)
            w = rng.uniform(0.4, 0.9)
            tau1 = rng.uniform(1.5, 6.0)
            tau2 = math.exp(rng.uniform(math.log(15.0), math.log(60.0)))
            vals = [
                0.1
                + (final - 0.1) * (1.0 - w * math.exp(-e / tau1) - (1.0 - w) * math.exp(-e / tau2))
                + rng.gauss(0.0, noise)
                for e in range(1, max_epochs + 1)
            ]
        out.append(Trace(f"c{i:03d}", epoch_s, tuple(min(max(v, 0.0), 1.0) for v in vals)))
    return out


@dataclass(frozen=True)
class SearchRun:
    policy: str
    time_to_target: float  # math.inf when no trial reached it
    end: float
    epochs_run: int
    suspensions: int
    kills: int
    completed: int


def simulate_search(
    traces: Sequence[Trace],
    policy: SearchPolicy,
    slots: int,
    target: float,
    suspend_s: float = 1.0,
    resume_s: float = 1.0,
    stop_at_target: bool = True,
) -> SearchRun:
    """Run the traces under ``policy`` on ``slots`` machines (see the module docstring)."""
    if slots < 1:
        raise InvalidArgument(f"simulate_search: slots must be >= 1, got {slots}")
    by_id = {t.id: t for t in traces}
    if len(by_id) != len(traces):
        raise InvalidArgument("simulate_search: trace ids must be unique")
    idle: dict[str, IdleJob] = {t.id: IdleJob(t.id, 0.0) for t in traces}
    done: dict[str, int] = {t.id: 0 for t in traces}
    events: list[tuple[float, int, str, str]] = []
    seq = itertools.count()
    free = slots
    now = 0.0
    reached = math.inf
    epochs = suspensions = kills = completed = 0

    def fill() -> None:
        nonlocal free
        while free and idle:
            job = policy.next_job(list(idle.values()))
            if job is None:
                return
            entry = idle.pop(job)
            free -= 1
            start = now + (resume_s if entry.suspended else 0.0)
            heapq.heappush(events, (start + by_id[job].epoch_s, next(seq), "epoch", job))

    fill()
    while events:
        now, _, kind, job = heapq.heappop(events)
        if kind == "free":  # a suspension finished: its checkpoint is saved, the trial waits for a slot
            free += 1
            idle[job] = IdleJob(job, now, suspended=True)
            fill()
            continue
        tr = by_id[job]
        done[job] += 1
        epochs += 1
        e = done[job]
        value = tr.values[e - 1]
        if value >= target and now < reached:
            reached = now
            if stop_at_target:
                break
        verdict = policy.on_epoch(job, e, value, now, tr.epoch_s, len(idle))
        if e >= tr.max_epochs:
            completed += 1
            free += 1
        elif verdict is Verdict.CONTINUE:
            heapq.heappush(events, (now + tr.epoch_s, next(seq), "epoch", job))
        elif verdict is Verdict.SUSPEND:
            suspensions += 1
            heapq.heappush(events, (now + suspend_s, next(seq), "free", job))
        else:
            kills += 1
            free += 1
        fill()
    return SearchRun(policy.name, reached, now, epochs, suspensions, kills, completed)
