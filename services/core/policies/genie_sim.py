"""An event-driven simulator of GENIE's evaluation (§IV): CNN tasks with deadlines on a small GPU cluster.

Tasks arrive by a Poisson process; each needs ``b * r`` samples of work on an exclusive placement of
``n`` nodes x ``g`` GPUs and runs for the platform's *true* latency there (Eq. 1-2 with the platform's
parameters). Schedulers only know the performance models fitted from a lightweight profile of the
platform with measurement noise (``profiled_models``). In scheduling rounds (every 30 s, like the
master's; arrivals and completions wait for the next round) the policy orders the waiting queue and picks
placements (``plan_queue``); tasks start in that order while their placement fits the free GPUs
(``launch``, with the same backfilling rule for every policy).

``genie_tasks`` generates GENIE's queues (Table II): Poisson arrivals over 24 hours at 5, 10 or 20 tasks
an hour; AlexNet, GoogleNet, ResNet50 or Inception-v3; training or inference; Urgent : Prior : Normal =
5 : 35 : 60; uniform choices otherwise.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.genie import (
    DEFAULT_THETA,
    ClusterShape,
    PerfModel,
    Placement,
    ProfileRun,
    Task,
    deadline_met,
    fit_perf_model,
    launch,
    lightweight_profile_plan,
    plan_queue,
)

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
    [5, 40 min] for inference (the iteration count is set to match)."""
    rng = random.Random(f"genie:{density_per_h}:{seed}")
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


@dataclass(frozen=True)
class QosRun:
    policy: str
    tasks: int
    met: int
    makespan: float
    mean_gpus: float  # GPUs per task placement, on average

    @property
    def qos_pct(self) -> float:
        return 100.0 * self.met / self.tasks if self.tasks else 100.0


def simulate_qos(
    tasks: Sequence[Task],
    policy: str,
    shape: ClusterShape,
    believed: Mapping[str, PerfModel],
    theta: float = DEFAULT_THETA,
    backfill: bool = True,
    truth: Mapping[str, PerfModel] | None = None,
    round_s: float = 30.0,
) -> QosRun:
    """Run the queue under ``policy``; QoS is judged against the ECT the system derives from ``believed``.

    The scheduler decides in rounds every ``round_s`` seconds (0: at every arrival and completion), as a
    master does; work that arrives or frees GPUs between rounds waits for the next one.
    """
    real = truth if truth is not None else true_models()
    free = {f"n{i}": shape.gpus_per_node for i in range(shape.nodes)}
    arrivals = sorted(tasks, key=lambda t: (t.arrival, t.id))
    events: list[tuple[float, int, str, str]] = []
    seq = itertools.count()
    for t in arrivals:
        heapq.heappush(events, (t.arrival, next(seq), "arrive", t.id))
    by_id = {t.id: t for t in tasks}
    if len(by_id) != len(tasks):
        raise InvalidArgument("simulate_qos: task ids must be unique")
    holding: dict[str, dict[str, int]] = {}
    waiting: list[Task] = []
    met = 0
    gpus_used = 0
    now = 0.0
    next_round = -math.inf
    while events:
        now = events[0][0]
        decide = False
        while events and events[0][0] == now:
            _, _, kind, tid = heapq.heappop(events)
            if kind == "arrive":
                waiting.append(by_id[tid])
            elif kind == "finish":
                for n, g in holding.pop(tid).items():
                    free[n] += g
                task = by_id[tid]
                met += deadline_met(task, now, believed[task.kind])
            else:
                decide = True
        if round_s > 0 and not decide:
            if next_round <= now:  # ask for the next round boundary, once
                next_round = (math.floor(now / round_s) + 1) * round_s
                heapq.heappush(events, (next_round, next(seq), "round", ""))
            continue
        plans = plan_queue(policy, waiting, now, believed, shape, theta, free)
        for plan, nodes in launch(plans, free, backfill):
            for n, g in nodes.items():
                free[n] -= g
            holding[plan.task.id] = nodes
            waiting.remove(plan.task)
            gpus_used += plan.placement.gpus
            lat = real[plan.task.kind].latency(plan.task.batch, plan.task.iterations, plan.placement)
            heapq.heappush(events, (now + lat, next(seq), "finish", plan.task.id))
    if waiting:
        raise InvalidArgument(f"simulate_qos: {len(waiting)} tasks never fit the cluster")
    return QosRun(policy, len(tasks), met, now, gpus_used / len(tasks) if tasks else 0.0)
