"""An event-driven simulator of Hermes' testbed: GPUs time-shared by hyper-parameter jobs reporting losses.

Every job trains ``iterations`` iterations of ``iter_s`` seconds and reports a (noisy) loss after each.
Jobs are placed by Alg. 1-2 (``place_jobs`` with ``G_thres``; the FIFO baseline uses ``G_thres = 1``,
Kubernetes' one job per GPU, the rest waiting in the global queue). On each GPU the node scheduler
(``node_round``) runs the best job for a quantum; a quantum ends after the iteration in flight when it
expires (Hermes' preemption module finishes the current iteration). Preempting costs ``save_s`` before
the next job can start and resuming a job that ran before costs ``restore_s`` (the checkpoint path).

The figure of merit is Hermes' (§4.2): the average time at which the good jobs reach 90% of the best
loss, i.e. their noise-free loss falls to ``best_final / 0.9``, where ``best_final`` is the lowest final
loss among all jobs; the jobs measured are the (up to) four best that get there.

``hermes_bin`` generates Hermes' job bins (§4.1.2): 16 jobs, 4 good (bin type 1) or 12 good (bin type 2),
in random submission order; good jobs converge fast to a low loss, the others slowly to a high one
(Fig. 2: fast / moderate / slow).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.hermes import (
    Hermes,
    RunningJob,
    TimeShareJob,
    TimeSharePolicy,
    node_round,
    place_jobs,
)


@dataclass(frozen=True)
class Model:
    """One CNN of the TensorFlow benchmark: seconds per iteration (Table 2: time for 1000 iterations)
    and the checkpoint save / restore costs of a preemption (Fig. 7)."""

    name: str
    iter_s: float
    save_s: float
    restore_s: float


# GoogleNet's and VGG19's preemption costs are the paper's (0.24 + 0.43 s; 1.57 s in all); VGG16's and
# ResNet50's are interpolated by model size.
MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        Model("googlenet", 0.03273, 0.24, 0.43),
        Model("vgg16", 0.09725, 0.50, 0.95),
        Model("vgg19", 0.11273, 0.55, 1.02),
        Model("resnet50", 0.06946, 0.35, 0.65),
    )
}


@dataclass(frozen=True)
class LossJob:
    """A job whose loss decays from ``l0`` towards ``l_inf`` with time constant ``tau`` iterations."""

    id: str
    l0: float
    l_inf: float
    tau: float
    good: bool
    losses: tuple[float, ...]  # reported loss after iterations 1..n (curve times lognormal noise)

    def curve(self, k: int) -> float:
        return self.l_inf + (self.l0 - self.l_inf) * math.exp(-k / self.tau)

    @property
    def iterations(self) -> int:
        return len(self.losses)


def hermes_bin(
    bin_type: int, seed: int = 0, iterations: int = 1000, n_jobs: int = 16, noise: float = 0.04
) -> list[LossJob]:
    """Bin type 1: 4 good jobs of 16; bin type 2: 12 good of 16; shuffled submission order.

    Losses start near ln(1000) (ImageNet, 1000 classes). Good jobs settle near the best loss in a few
    hundred iterations, the better ones faster; the rest converge slowly (tau of a thousand or more
    iterations) to a loss far above it.
    """
    if bin_type not in (1, 2):
        raise InvalidArgument(f"hermes_bin: bin_type must be 1 or 2, got {bin_type}")
    n_good = 4 if bin_type == 1 else 12
    rng = random.Random(f"hermes:{bin_type}:{seed}")
    nrng = np.random.default_rng(rng.randrange(1 << 32))
    best = 2.4
    out = []
    for i in range(n_jobs):
        good = i < n_good
        l0 = rng.uniform(6.6, 7.0)
        if good:
            # Hermes' premise (Fig. 2): the better a combination, the faster it converges early on.
            quality = rng.random()
            l_inf = best * (1.0 + (0.03 if bin_type == 1 else 0.25) * quality)
            tau = 60.0 + 160.0 * (0.7 * quality + 0.3 * rng.random())
        else:
            l_inf = rng.uniform(3.6, 6.2)
            tau = rng.uniform(600.0, 3000.0)
        k = np.arange(1, iterations + 1)
        clean = l_inf + (l0 - l_inf) * np.exp(-k / tau)
        noisy = clean * np.exp(nrng.normal(0.0, noise, iterations))
        out.append(LossJob("", l0, l_inf, tau, good, tuple(float(v) for v in noisy)))
    rng.shuffle(out)
    return [LossJob(f"j{i:02d}", j.l0, j.l_inf, j.tau, j.good, j.losses) for i, j in enumerate(out)]


def goal_iterations(jobs: Sequence[LossJob], goal: float = 0.9, measured: int = 4) -> dict[str, int]:
    """For the (up to) ``measured`` best jobs that reach ``best_final / goal``: the first iteration at which
    their noise-free loss does."""
    best_final = min(j.curve(j.iterations) for j in jobs)
    threshold = best_final / goal
    out: dict[str, int] = {}
    for j in sorted(jobs, key=lambda j: (j.curve(j.iterations), j.id)):
        if len(out) >= measured:
            break
        k = next((k for k in range(1, j.iterations + 1) if j.curve(k) <= threshold), None)
        if k is not None:
            out[j.id] = k
    return out


@dataclass(frozen=True)
class TimeShareRun:
    policy: str
    reach: dict[str, float]  # measured job -> time its loss reached the goal
    makespan: float
    preemptions: int
    finished: dict[str, float] = field(default_factory=dict)

    @property
    def mean_reach(self) -> float:
        return sum(self.reach.values()) / len(self.reach) if self.reach else math.inf


@dataclass
class _Gpu:
    id: str
    queue: list[str] = field(default_factory=list)
    running: str | None = None
    started: float = 0.0  # when the running job's quantum started (after its restore)
    busy_until: float = 0.0


def simulate_time_sharing(
    jobs: Sequence[LossJob],
    policy: TimeSharePolicy,
    model: Model,
    gpus: int = 4,
    g_thres: int = 4,
    goal: float = 0.9,
    measured: int = 4,
) -> TimeShareRun:
    """Run the jobs (all submitted at t = 0, in list order) on ``gpus`` GPUs under ``policy``."""
    if gpus < 1 or g_thres < 1:
        raise InvalidArgument(f"simulate_time_sharing: gpus and g_thres must be >= 1, got {gpus}, {g_thres}")
    by_id = {j.id: j for j in jobs}
    targets = goal_iterations(jobs, goal, measured)
    state = {j.id: TimeShareJob(j.id, arrival=float(i)) for i, j in enumerate(jobs)}
    done = dict.fromkeys(by_id, 0)
    ran: set[str] = set()
    gs = {f"g{i}": _Gpu(f"g{i}") for i in range(gpus)}
    backlog = [j.id for j in jobs]
    milestones = policy.milestones if isinstance(policy, Hermes) else ()
    events: list[tuple[float, int, str]] = []
    seq = itertools.count()
    reach: dict[str, float] = {}
    finished: dict[str, float] = {}
    preemptions = 0
    now = 0.0

    def place() -> None:
        load = {g.id: len(g.queue) for g in gs.values()}
        for job, gpu in place_jobs(backlog, load, g_thres).items():
            gs[gpu].queue.append(job)
            backlog.remove(job)

    def start(g: _Gpu, job: str, at: float, keep: bool = False) -> None:
        """Run ``job`` on ``g`` for one quantum from ``at``: restore its checkpoint first if it ran before,
        unless it ``keep``s the GPU it already holds."""
        begin = at + (model.restore_s if job in ran and not keep else 0.0)
        ran.add(job)
        g.running, g.started = job, begin
        lj = by_id[job]
        q = policy.quantum(state[job])
        left = lj.iterations - done[job]
        n = left if math.isinf(q) else min(left, max(1, math.ceil(q / model.iter_s - 1e-9)))
        k = targets.get(job)
        if k is not None and job not in reach and done[job] < k <= done[job] + n:
            reach[job] = begin + (k - done[job]) * model.iter_s
        g.busy_until = begin + n * model.iter_s
        heapq.heappush(events, (g.busy_until, next(seq), g.id))

    def decide(g: _Gpu, at: float, cur: RunningJob | None) -> None:
        nonlocal preemptions
        waiting = {g.id: [state[j] for j in g.queue]}
        switches = node_round(policy, {g.id: cur}, waiting, at)
        if not switches:
            if cur is not None:
                start(g, cur.job.id, at, keep=True)  # another quantum on the GPU it holds: nothing to save
            else:
                g.running = None
            return
        sw = switches[0]
        if sw.stop is not None:
            preemptions += 1
            at += model.save_s
        start(g, sw.start, at)

    place()
    for g in gs.values():
        decide(g, 0.0, None)
    while events:
        now, _, gid = heapq.heappop(events)
        g = gs[gid]
        job = g.running
        assert job is not None
        lj = by_id[job]
        n = round((now - g.started) / model.iter_s)
        losses = lj.losses[done[job] : done[job] + n]
        done[job] += n
        state[job].record(losses, now, milestones)
        if done[job] >= lj.iterations:
            finished[job] = now
            g.queue.remove(job)
            place()
            for other in gs.values():  # a job placed on an idle GPU starts right away
                if other is not g and other.running is None and other.queue:
                    decide(other, now, None)
            decide(g, now, None)
        else:
            decide(g, now, RunningJob(state[job], g.started))
    return TimeShareRun(policy.name, reach, now, preemptions, finished)
