"""Hermes (Son et al., Electronics 2021): convergence-aware preemptive time-sharing, with its baselines.

Two levels, as in the paper:

* **global placement** (Alg. 1-2): each arriving job goes to the GPU with the fewest jobs, among GPUs
  holding fewer than ``G_thres`` (4); when every GPU is full the job waits in the global queue.
  ``find_available_gpu`` / ``place_jobs``.
* **node scheduling** (Alg. 3): every slot time-shares its jobs. When the running job's time quantum
  expires, the job with the largest convergence ``C_j(i)`` runs next; the running job competes too (it
  simply keeps the GPU when it is still the best, so no checkpoint is paid for nothing). A job that has
  never run has no ``C`` yet and goes first (its first quantum measures ``C_j(0)``).

Convergence (Eq. 2-4): over the losses ``L_j(i)`` a job reported in its ``i``-th quantum the
representative loss is ``loss_j(i) = (max L_j(i) + min L_j(i)) / 2``; then
``C_j(i) = (loss_j(i - 1) - loss_j(i)) / |L_j(i)|``, and for the first quantum
``C_j(0) = (max L_j(0) - min L_j(0)) / |L_j(0)|``: loss decrease per reported iteration.

The quantum starts at ``quantum_s`` (10 s) and is multiplied by ``growth`` each time the job passes one
of the user's loss milestones (fractions of its initial representative loss shed), so that the shrinking
slope differences between converging jobs stay measurable.

Baselines (§4.1.3), under the same interface: ``fifo`` (no preemption; a job runs to its end),
``rr`` (Gandiva-style round robin, 30 s quantum), ``slaq`` (SLAQ's quality-driven rule, 30 s quantum:
the job with the largest predicted loss reduction in the next quantum, normalized by the largest
reduction the job has shown so far, which favours jobs far from convergence — the poorly performing ones).

Plug-in interface for the master's Preempt step (plain data in, plain data out)::

    policy = time_share_policy("hermes")             # or "fifo", "rr", "slaq"
    job.record(losses, now)                          # after each quantum: the losses the job reported
    switches = node_round(policy, running, waiting, now)
        # running: slot -> RunningJob(job, started) or None; waiting: slot -> [TimeShareJob, ...]
        # -> [Switch(slot, stop=job id or None, start=job id)]; a ``stop`` is a Preempt (finish the step,
        #    save a peripheral checkpoint); the remaining work re-enters the stage tree from it.
    slot = find_available_gpu(load, g_thres)         # Alg. 2 (load: slot -> jobs assigned)
    TimeShareJob.restore(job.id, job.snapshot())     # the job's state as plain JSON data, and back

Because a preempted job resumes from a checkpoint, the live master may also re-place it on another slot
(``place_jobs`` again); the simulator keeps Hermes' per-GPU queues, as the paper's node schedulers do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.plain import dec, enc

G_THRES = 4


def representative_loss(losses: Sequence[float]) -> float:
    """Eq. 2: the mid-range of the losses of one quantum, robust to the fluctuation within it."""
    if not losses:
        raise InvalidArgument("representative_loss: a quantum with no losses")
    return (max(losses) + min(losses)) / 2.0


def convergence(losses: Sequence[float], previous: float | None) -> float:
    """Eq. 3 (``previous`` = the representative loss of the quantum before) or Eq. 4 (first quantum)."""
    if not losses:
        raise InvalidArgument("convergence: a quantum with no losses")
    if previous is None:
        return (max(losses) - min(losses)) / len(losses)
    return (previous - representative_loss(losses)) / len(losses)


@dataclass(frozen=True)
class Quantum:
    """What one quantum of a job measured."""

    rep: float  # Eq. 2
    hi: float
    lo: float
    count: int  # |L_j(i)|
    convergence: float  # Eq. 3 / 4
    end: float  # when the quantum ended


@dataclass
class TimeShareJob:
    """The per-job state the node scheduler keeps (plain data; the master persists it)."""

    id: str
    arrival: float = 0.0
    quanta: list[Quantum] = field(default_factory=list)
    milestones_passed: int = 0

    def record(self, losses: Sequence[float], now: float, milestones: Sequence[float] = ()) -> Quantum:
        """Add one quantum's losses; count the loss milestones (fractions shed from the first
        representative loss) now passed."""
        prev = self.quanta[-1].rep if self.quanta else None
        q = Quantum(representative_loss(losses), max(losses), min(losses), len(losses), convergence(losses, prev), now)
        self.quanta.append(q)
        first = self.quanta[0].rep
        if first > 0:
            shed = 1.0 - q.rep / first
            self.milestones_passed = max(self.milestones_passed, sum(1 for m in milestones if shed >= m))
        return q

    def copy(self) -> TimeShareJob:
        return TimeShareJob(self.id, self.arrival, list(self.quanta), self.milestones_passed)

    @property
    def last_run(self) -> float:
        return self.quanta[-1].end if self.quanta else -math.inf

    def snapshot(self) -> dict[str, Any]:
        """Plain JSON data: ``{"arrival", "milestones_passed", "quanta": [[rep, hi, lo, count, C, end], ...]}``
        (the id is the key it is filed under)."""
        return {
            "arrival": enc(self.arrival),
            "milestones_passed": self.milestones_passed,
            "quanta": [
                [enc(q.rep), enc(q.hi), enc(q.lo), q.count, enc(q.convergence), enc(q.end)] for q in self.quanta
            ],
        }

    @classmethod
    def restore(cls, job_id: str, data: Mapping[str, Any]) -> TimeShareJob:
        """The job ``snapshot`` described: it scores, and its quantum lasts, as the original's did."""
        quanta = [Quantum(dec(r), dec(h), dec(lo), int(n), dec(c), dec(e)) for r, h, lo, n, c, e in data["quanta"]]
        return cls(job_id, dec(data["arrival"]), quanta, int(data["milestones_passed"]))


@dataclass(frozen=True)
class RunningJob:
    job: TimeShareJob
    started: float  # when its current quantum started


@dataclass(frozen=True)
class Switch:
    """On ``slot``: preempt ``stop`` (None if the slot was idle) and run ``start``."""

    slot: str
    stop: str | None
    start: str


class TimeSharePolicy(Protocol):
    @property
    def name(self) -> str: ...

    def quantum(self, job: TimeShareJob) -> float:
        """Seconds the job may hold the GPU before it can be preempted (``math.inf``: never)."""
        ...

    def score(self, job: TimeShareJob, now: float) -> float:
        """Larger runs first."""
        ...


@dataclass(frozen=True)
class Hermes:
    """Largest convergence first; the quantum grows ``growth``-fold per loss milestone passed."""

    quantum_s: float = 10.0
    growth: float = 2.0
    milestones: tuple[float, ...] = (0.3, 0.45, 0.6)
    name: str = "hermes"

    def quantum(self, job: TimeShareJob) -> float:
        return self.quantum_s * self.growth**job.milestones_passed

    def score(self, job: TimeShareJob, now: float) -> float:
        return job.quanta[-1].convergence if job.quanta else math.inf


@dataclass(frozen=True)
class Fifo:
    """Kubernetes' default: in arrival order, no preemption."""

    name: str = "fifo"

    def quantum(self, job: TimeShareJob) -> float:
        return math.inf

    def score(self, job: TimeShareJob, now: float) -> float:
        return -job.arrival


@dataclass(frozen=True)
class RoundRobin:
    """Gandiva / Tiresias / Themis time-sharing: the job that has waited longest runs next."""

    quantum_s: float = 30.0
    name: str = "rr"

    def quantum(self, job: TimeShareJob) -> float:
        return self.quantum_s

    def score(self, job: TimeShareJob, now: float) -> float:
        return -job.last_run if job.quanta else math.inf


@dataclass(frozen=True)
class Slaq:
    """SLAQ's quality-driven rule: predicted loss reduction in the next quantum, normalized per job.

    The per-iteration reduction of the next quantum is extrapolated geometrically from the last two
    quanta (exact for the exponential tail of a loss curve) and divided by the largest per-iteration
    reduction the job has shown; a job that has not run yet, or has run once, scores 1 (new work first).
    """

    quantum_s: float = 30.0
    name: str = "slaq"

    def quantum(self, job: TimeShareJob) -> float:
        return self.quantum_s

    def score(self, job: TimeShareJob, now: float) -> float:
        if not job.quanta:
            return math.inf
        rates = [q.convergence for q in job.quanta]
        top = max(rates)
        if top <= 0:
            return 0.0
        last = rates[-1]
        if len(rates) < 2:
            return last / top
        prev = rates[-2]
        ratio = min(max(last / prev, 0.0), 1.0) if prev > 0 else 1.0
        return max(last, 0.0) * ratio / top


TIME_SHARE_POLICIES: Mapping[str, Callable[[], TimeSharePolicy]] = {
    "hermes": Hermes,
    "fifo": Fifo,
    "rr": RoundRobin,
    "slaq": Slaq,
}


def time_share_policy(name: str) -> TimeSharePolicy:
    factory = TIME_SHARE_POLICIES.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown time-sharing policy {name!r}; known: {sorted(TIME_SHARE_POLICIES)}")
    return factory()


def find_available_gpu(load: Mapping[str, int], g_thres: int = G_THRES) -> str | None:
    """Alg. 2: the GPU with the fewest jobs among those below ``g_thres`` (first such on ties)."""
    cand: str | None = None
    for gpu, n in load.items():
        if n < g_thres and (cand is None or n < load[cand]):
            cand = gpu
    return cand


def place_jobs(jobs: Sequence[str], load: Mapping[str, int], g_thres: int = G_THRES) -> dict[str, str]:
    """Alg. 1: place jobs in order while some GPU has room; the rest stay in the global queue."""
    counts = dict(load)
    out: dict[str, str] = {}
    for job in jobs:
        gpu = find_available_gpu(counts, g_thres)
        if gpu is None:
            break
        out[job] = gpu
        counts[gpu] += 1
    return out


def _key(policy: TimeSharePolicy, job: TimeShareJob, now: float) -> tuple[float, float, str]:
    return (-policy.score(job, now), job.arrival, job.id)


def node_round(
    policy: TimeSharePolicy,
    running: Mapping[str, RunningJob | None],
    waiting: Mapping[str, Sequence[TimeShareJob]],
    now: float,
) -> list[Switch]:
    """Alg. 3 over every slot: where the slot is idle, or its job's quantum has expired, run the best
    job by the policy's score (the running job included); a different job means a preemption."""
    out: list[Switch] = []
    for slot in sorted(set(running) | set(waiting)):
        cur = running.get(slot)
        queue = [j for j in waiting.get(slot, ()) if cur is None or j.id != cur.job.id]
        if cur is not None and now - cur.started < policy.quantum(cur.job) - 1e-9:
            continue  # not preemptible yet
        candidates = queue if cur is None else [*queue, cur.job]
        if not candidates:
            continue
        best = min(candidates, key=lambda j: _key(policy, j, now))
        if cur is None or best.id != cur.job.id:
            out.append(Switch(slot, None if cur is None else cur.job.id, best.id))
    return out
