"""Hermes' testbed (§4), as a workload of the simulator: GPUs time-shared by hyper-parameter jobs that
report a loss after every iteration.

Every job trains ``iterations`` iterations (one step each) of ``iter_s`` seconds and reports a (noisy)
loss after each. The study's ``time_share`` policy decides (``hermes``, or the baselines ``fifo``, ``rr``,
``slaq`` with the quanta the paper gives them); FIFO is Kubernetes' default, one job per GPU
(``g_thres`` 1), the rest in the global queue. A preemption finishes the iteration in flight and saves
(``save_s``, holding the GPU); resuming restores (``restore_s``).

The figure of merit is Hermes' (§4.2): the average time at which the good jobs reach 90% of the best
loss, i.e. their noise-free loss falls to ``best_final / 0.9``, where ``best_final`` is the lowest final
loss among all jobs; the jobs measured are the (up to) four best that get there.

``hermes_bin`` generates Hermes' job bins (§4.1.2): 16 jobs, 4 good (bin type 1) or 12 good (bin type 2),
in random submission order; good jobs converge fast to a low loss, the others slowly to a high one
(Fig. 2: fast / moderate / slow).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stagetree.core.config import Config
from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.study import parse_policies
from stagetree.core.simulator import Ask, SimReport, Simulator
from stagetree.core.slots import Slot
from tests.sim.papers import index_of


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
class HermesWorkload:
    """The simulator's workload: iteration ``step`` of job ``config["job"]`` takes the model's time and
    reports the job's noisy loss."""

    jobs: Sequence[LossJob]
    model: Model

    def step_s(self, config: Config, step: int, slots: int, gpu_type: str) -> float:
        return self.model.iter_s

    def metrics(self, config: Config, step: int) -> dict[str, float]:
        job = self.jobs[job_index(config)]
        return {"loss": job.losses[min(step, job.iterations) - 1]} if step > 0 else {"loss": job.l0}


class AllJobs:
    """Submits every job to its last iteration at once, in list order."""

    def __init__(self, jobs: Sequence[LossJob], study: str = "hermes", plan: str = "hermes") -> None:
        self.jobs, self.study, self.plan = jobs, study, plan

    def start(self) -> list[Ask]:
        return [Ask(j.id, job_config(i), j.iterations, self.study, self.plan) for i, j in enumerate(self.jobs)]

    def on_result(self, tag: object, step: int, metrics: dict[str, float]) -> list[Ask]:
        return []


def job_config(i: int) -> Config:
    return Config.of({"job": i})


def job_index(config: Config) -> int:
    return index_of(config, "job")


# The quanta of the paper's policies (§4.1.3): Hermes 10 s, growing at loss milestones; RR and SLAQ 30 s.
QUANTUM_S = {"hermes": 10.0, "rr": 30.0, "slaq": 30.0, "fifo": 30.0}


def time_share_policies(name: str, g_thres: int | None = None) -> dict[str, object]:
    """A study's ``policies`` for one of the time-sharing policies, as the paper ran it (FIFO one job per
    GPU, the others ``G_thres`` 4) unless ``g_thres`` says otherwise."""
    cap = g_thres if g_thres is not None else 1 if name == "fifo" else 4
    params: dict[str, object] = {"quantum_s": QUANTUM_S[name], "g_thres": cap}
    return {"time_share": name, "time_share_params": params}


@dataclass(frozen=True)
class TimeShareRun:
    policy: str
    reach: dict[str, float]  # measured job -> time its loss reached the goal
    report: SimReport

    @property
    def mean_reach(self) -> float:
        return sum(self.reach.values()) / len(self.reach) if self.reach else math.inf


def gpus(n: int, host: str = "hermes") -> list[Slot]:
    return [Slot(f"g{i}", host, "gpu", i) for i in range(n)]


def run_time_sharing(
    jobs: Sequence[LossJob],
    policy: str,
    model: Model,
    n_gpus: int = 4,
    goal: float = 0.9,
    measured: int = 4,
    g_thres: int | None = None,
) -> TimeShareRun:
    """The jobs (all submitted at t = 0) on ``n_gpus`` GPUs under the time-sharing ``policy``, through the
    live scheduling round."""
    targets = goal_iterations(jobs, goal, measured)
    want = {(i, targets[j.id]): j.id for i, j in enumerate(jobs) if j.id in targets}
    reach: dict[str, float] = {}

    def on_step(config: Config, step: int, t: float) -> None:
        job = want.get((job_index(config), step))
        if job is not None and job not in reach:
            reach[job] = t

    sim = Simulator(
        AllJobs(jobs),
        gpus(n_gpus),
        workload=HermesWorkload(jobs, model),
        policies={"hermes": parse_policies(time_share_policies(policy, g_thres))},
        load_s=model.restore_s,
        save_s=model.save_s,
        on_step=on_step,
    )
    return TimeShareRun(policy, reach, sim.run())
