"""GENIE's evaluation (§IV-B, Fig. 4), as a workload of the simulator: CNN tasks with deadlines.

Tasks arrive by a Poisson process over 24 hours; each is a study of its own with GENIE's QoS class
(Urgent : Prior : Normal = 5 : 35 : 60) and ``slots`` 4, one request of one step whose time is the
platform's *true* latency (Eq. 1-2 with the platform's parameters) on the slots it gets, all of one
node (the live round places a batch's slots on one node manager). The round only knows the models
fitted from a lightweight profile of the platform with measurement noise (``profiled_models``): its
cost table is their latency on one slot and their ratio on n slots. The study's ``width`` policy picks
the slots (GENIE's cost-effective ratio under the deadline, or a baseline) and the order across studies
(GENIE's waiting allowance; arrival order for the baselines). A task meets its QoS when it finishes by
the ECT the system derives from the fitted model (Eq. 4).

``genie_tasks`` generates GENIE's queues (Table II): Poisson arrivals over 24 hours at 5, 10 or 20 tasks
an hour; AlexNet, GoogleNet, ResNet50 or Inception-v3; training or inference; uniform choices otherwise.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stagetree.core.config import Config
from stagetree.core.policies.genie import (
    ClusterShape,
    PerfModel,
    Placement,
    ProfileRun,
    Task,
    deadline_met,
    fit_perf_model,
    lightweight_profile_plan,
)
from stagetree.core.policies.study import parse_policies
from stagetree.core.simulator import Ask, SimReport, Simulator
from stagetree.core.slots import Slot
from stagetree.core.stagetree import Stage
from tests.sim.papers import index_of

# Per model on a K80 GPU (training): saturated images/s per GPU, the local batch that saturates it,
# and the communication weights across nodes (56 Gb/s InfiniBand) and within one (PCIe, no NVLink).
CNN_MODELS: dict[str, tuple[float, float, float, float]] = {
    "alexnet": (620.0, 128.0, 1.2, 0.45),
    "googlenet": (150.0, 48.0, 0.6, 0.25),
    "resnet50": (52.0, 32.0, 0.7, 0.3),
    "inception3": (34.0, 32.0, 0.6, 0.3),
}
INFERENCE_SPEEDUP = 3.0
STARTUP_S = 20.0
BATCHES = (64, 128, 256, 512)
PROFILE_BATCHES = (4, 8, 16, 32, 64, 128, 256, 512)
QOS_MIX = (("urgent", 0.05), ("prior", 0.35), ("normal", 0.60))


def true_models() -> dict[str, PerfModel]:
    """The platform: ``pbar(x) = P (2 x / s - (x / s)^2)`` up to the saturating batch ``s``, flat beyond."""
    out = {}
    for name, (peak, sat, lam1, lam2) in CNN_MODELS.items():
        out[f"{name}:train"] = PerfModel(0.0, 2 * peak / sat, -peak / sat**2, lam1, lam2, STARTUP_S)
        p = peak * INFERENCE_SPEEDUP
        out[f"{name}:infer"] = PerfModel(0.0, 2 * p / sat, -p / sat**2, 0.0, 0.0, STARTUP_S)
    return out


def profiled_models(shape: ClusterShape, noise: float = 0.05, seed: int = 0) -> dict[str, PerfModel]:
    """Fit every kind from its ``B + N + G`` profiling runs on the true platform, each measured with
    ``noise`` relative error."""
    rng = random.Random(f"genie-profile:{seed}")
    out = {}
    for kind, m in true_models().items():
        # Single-GPU batches from the smallest local batch a placement makes up to the largest global one.
        plan = lightweight_profile_plan(PROFILE_BATCHES, shape.nodes, shape.gpus_per_node, batch=256)
        runs = [ProfileRun(b, pl, m.throughput(b, pl) * (1 + rng.uniform(-noise, noise))) for b, pl in plan]
        out[kind] = fit_perf_model(runs, STARTUP_S, inference=kind.endswith(":infer"))
    return out


def genie_tasks(density_per_h: float, hours: float = 24.0, seed: int = 0) -> list[Task]:
    """Poisson arrivals; single-GPU latencies log-uniform in [20 min, 3 h] for training and
    [5, 40 min] for inference (the iteration count is set to match). The same density gives the same
    tasks however it is written (20 or 20.0)."""
    rng = random.Random(f"genie:{density_per_h:.17g}:{seed}")
    models = true_models()
    out = []
    t = rng.expovariate(density_per_h / 3600.0)
    i = 0
    while t < hours * 3600.0:
        model = rng.choice(sorted(CNN_MODELS))
        calc = rng.choice(("train", "infer"))
        kind = f"{model}:{calc}"
        batch = float(rng.choice(BATCHES))
        lo, hi = (1200.0, 10800.0) if calc == "train" else (300.0, 2400.0)
        l1 = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        iterations = (l1 - STARTUP_S) * models[kind].throughput(batch, Placement(1, 1)) / batch
        u = rng.random()
        qos = next(q for q, c in itertools.accumulate(QOS_MIX, lambda a, b: (b[0], a[1] + b[1])) if u < c)
        out.append(Task(f"t{i:04d}", kind, batch, iterations, t, qos))
        i += 1
        t += rng.expovariate(density_per_h / 3600.0)
    return out


def task_index(config: Config) -> int:
    return index_of(config, "task")


@dataclass(frozen=True)
class TaskWorkload:
    """A task's one step takes the platform's true latency on the slots it runs on (one node)."""

    tasks: Sequence[Task]
    truth: Mapping[str, PerfModel]

    def step_s(self, config: Config, step: int, slots: int, gpu_type: str) -> float:
        t = self.tasks[task_index(config)]
        return self.truth[t.kind].latency(t.batch, t.iterations, Placement(1, slots))

    def metrics(self, config: Config, step: int) -> dict[str, float]:
        return {"done": 1.0}


class Arrivals:
    """Each task at its arrival, as a study of its own."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.tasks = tasks

    def start(self) -> list[Ask]:
        return [Ask(t.id, Config.of({"task": i}), 1, t.id, t.id, t.arrival) for i, t in enumerate(self.tasks)]

    def on_result(self, tag: object, step: int, metrics: dict[str, float]) -> list[Ask]:
        return []


@dataclass(frozen=True)
class QosRun:
    policy: str
    tasks: int
    met: int
    makespan: float
    report: SimReport

    @property
    def qos_pct(self) -> float:
        return 100.0 * self.met / self.tasks if self.tasks else 100.0


def run_qos(tasks: Sequence[Task], policy: str, shape: ClusterShape, believed: Mapping[str, PerfModel]) -> QosRun:
    """The queue under the width ``policy`` through the live scheduling round, on ``shape`` (nodes x
    GPUs); QoS is judged against the ECT the system derives from ``believed``."""
    by_id = {t.id: t for t in tasks}
    slots = [Slot(f"n{n}g{g}", f"n{n}", "k80", g) for n in range(shape.nodes) for g in range(shape.gpus_per_node)]
    policies = {t.id: parse_policies({"qos": t.qos, "width": policy, "slots": shape.gpus_per_node}) for t in tasks}

    def cost(st: Stage) -> float:
        t = by_id[sim.by_id[st.plan].key]
        return believed[t.kind].latency(t.batch, t.iterations, Placement(1, 1)) * (st.end - st.start)

    def scale(plan: str, n: int) -> float:
        t, m = by_id[plan], believed[by_id[plan].kind]
        return m.latency(t.batch, t.iterations, Placement(1, n)) / m.latency(t.batch, t.iterations, Placement(1, 1))

    sim = Simulator(
        Arrivals(tasks),
        slots,
        workload=TaskWorkload(tasks, true_models()),
        policies=policies,
        decision_cost=cost,
        decision_scale=scale,
        boundaries=False,
    )
    report = sim.run()
    met = sum(deadline_met(by_id[tag], at, believed[by_id[tag].kind]) for tag, at in report.served_at.items())
    return QosRun(policy, len(tasks), met, report.makespan, report)
