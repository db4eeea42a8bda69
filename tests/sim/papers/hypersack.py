"""HyperSack's evaluation (§V), as a workload of the simulator: trials packed on shared GPUs (MPS).

Each GPU is registered as ``slots_per_gpu`` slots (shares of it) with its memory and its node's CPU
cores split among them, so a device can hold as many trials as its slots. A study per profile key
(model, batch size) declares the demand the Sampler measured (``estimates``: compute %, memory, CPU
cores) and chooses a ``placement`` policy (``ff``, ``ffd``, ``wf``, ``wfd`` or the baseline
``one_per_gpu``) with HyperSack's oversubscription ratio; the trials run their *true* demands.

A trial alone on a GPU type takes ``runtime_s`` and keeps that GPU busy a fraction ``u = compute / 100``
of the time (the rest is data loading on the CPU). Co-located, trial ``j`` slows down by
(``PackContention``)

    max(1 + u_j * (U - u_j),   U,   cpus_node / Q_node) * (1 + interference * (k - 1))

where ``U`` sums ``u`` over the ``k`` trials on its GPU: its GPU phases meet the others' in proportion
to their busy fractions; a saturated GPU (``U > 1``) shares out exactly its capacity; an oversubscribed
node's CPUs stretch the data loading; and each co-runner adds a little context-switching overhead. So
packing pays while the GPU has idle bubbles, and oversubscribing too far costs.

``sp_workload`` builds HyperSack's search spaces (Table II): six lightweight vision models x four batch
sizes x four learning rates = 96 trials (SP1), with utilization under 50% on an A100.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stagetree.core.config import Config
from stagetree.core.policies.packing import Demand, PackItem
from stagetree.core.policies.study import StudyPolicies, parse_policies
from stagetree.core.simulator import Ask, Fault, SimReport, Simulator
from stagetree.core.slots import Slot
from stagetree.core.stagetree import Stage
from tests.sim.papers import index_of

GB = 1e9
STEPS = 20  # steps per trial: the contention model's pace changes at any point of a step


@dataclass(frozen=True)
class PackJob:
    """A trial: its profile key (model, batch size) and its true demands per GPU type."""

    id: str
    key: tuple[str, int]
    true: Mapping[str, Demand]


# Model -> (A100 utilization at batch 64, A100 minutes per trial at batch 64, memory GB at batch 64).
VISION_MODELS: dict[str, tuple[float, float, float]] = {
    "shufflenet": (18.0, 16.0, 1.6),
    "mobilenet": (21.0, 18.0, 2.2),
    "vit_tiny": (25.0, 20.0, 2.0),
    "deit_tiny": (26.0, 21.0, 2.1),
    "resnet18": (30.0, 24.0, 2.4),
    "resnet34": (36.0, 32.0, 3.4),
}
BATCH_SIZES = (64, 128, 256, 512)
# Bigger batches keep the GPU busier and finish an epoch sooner.
_BS_UTIL = {64: 1.0, 128: 1.15, 256: 1.28, 512: 1.36}
_BS_TIME = {64: 1.0, 128: 0.78, 256: 0.66, 512: 0.6}
_BS_MEM = {64: 1.0, 128: 1.6, 256: 2.8, 512: 5.0}
# GPU type -> (utilization factor, time factor) against an A100: an H100 is faster and less busy.
GPU_TYPES: dict[str, tuple[float, float]] = {"a100": (1.0, 1.0), "h100": (0.72, 0.62)}


def sp_workload(n_lr: int = 4, seed: int = 0, models: Sequence[str] = tuple(VISION_MODELS)) -> list[PackJob]:
    """Grid order: model x batch size x learning rate (the rate does not change the cost), with a few
    percent of run-to-run jitter per trial."""
    rng = random.Random(f"sp:{seed}")
    out = []
    for m in models:
        util, minutes, mem = VISION_MODELS[m]
        for bs in BATCH_SIZES:
            for lr in range(n_lr):
                true = {}
                for t, (uf, tf) in GPU_TYPES.items():
                    true[t] = Demand(
                        compute=min(util * _BS_UTIL[bs] * uf * rng.uniform(0.95, 1.05), 49.0),
                        memory=mem * _BS_MEM[bs],
                        cpus=float(rng.choice((2, 3, 4))),
                        runtime_s=60.0 * minutes * _BS_TIME[bs] * tf * rng.uniform(0.95, 1.05),
                    )
                out.append(PackJob(f"{m}-{bs}-{lr}", (m, bs), true))
    return out


def estimates(jobs: Sequence[PackJob], error: float = 0.05, seed: int = 0) -> dict[str, PackItem]:
    """What the Sampler would report: one profile per (model, batch size, GPU type), measured with
    ``error`` relative noise and shared by every trial with that key (the job history)."""
    rng = random.Random(f"profile:{seed}")
    book: dict[tuple[tuple[str, int], str], Demand] = {}
    out = {}
    for j in jobs:
        dem = {}
        for t, d in j.true.items():
            prof = book.get((j.key, t))
            if prof is None:
                prof = Demand(
                    d.compute * (1 + rng.uniform(-error, error)),
                    d.memory,
                    d.cpus,
                    d.runtime_s * (1 + rng.uniform(-error, error)),
                )
                book[(j.key, t)] = prof
            dem[t] = prof
        out[j.id] = PackItem(j.id, dem)
    return out


def gpu_slots(
    prefix: str, gpu_type: str, n_gpus: int, per_node: int, cores: int, slots_per_gpu: int, first: int = 0
) -> list[Slot]:
    """``n_gpus`` GPUs of 80 GB, ``per_node`` a node of ``cores`` CPU cores, each GPU as ``slots_per_gpu``
    slots with an even share of its memory and of its node's cores (which must divide evenly)."""
    per_slot_cores, rest = divmod(cores, per_node * slots_per_gpu)
    if rest:
        raise ValueError(f"{cores} cores do not split over {per_node} x {slots_per_gpu} slots")
    out = []
    for g in range(first, first + n_gpus):
        node, index = f"n{prefix}{g // per_node}", g % per_node
        out += [
            Slot(f"{prefix}{g}.{k}", node, gpu_type, index, int(80 * GB) // slots_per_gpu, per_slot_cores)
            for k in range(slots_per_gpu)
        ]
    return out


def a100_slots(n_gpus: int, first: int = 0) -> list[Slot]:
    """HyperSack's A100 nodes: four 80 GB GPUs and 88 cores each."""
    return gpu_slots("a", "a100", n_gpus, 4, 88, 11, first)


def h100_slots(n_gpus: int, first: int = 0) -> list[Slot]:
    """HyperSack's H100 nodes: two 80 GB GPUs and 96 cores each."""
    return gpu_slots("h", "h100", n_gpus, 2, 96, 12, first)


def host_cores(slots: Sequence[Slot]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in slots:
        out[s.node_manager] = out.get(s.node_manager, 0.0) + s.cpu_cores
    return out


def trial_index(config: Config) -> int:
    return index_of(config, "trial")


@dataclass(frozen=True)
class PackWorkload:
    """A trial's steps take its true run time (on the GPU type it runs on) over ``STEPS``."""

    jobs: Sequence[PackJob]

    def step_s(self, config: Config, step: int, slots: int, gpu_type: str) -> float:
        return self.jobs[trial_index(config)].true[gpu_type].runtime_s / STEPS

    def metrics(self, config: Config, step: int) -> dict[str, float]:
        return {"loss": 1.0 / (1 + step)}


@dataclass(frozen=True)
class PackContention:
    """HyperSack's co-location slowdown (see the module docstring), from the trials' true demands."""

    jobs: Sequence[PackJob]
    interference: float = 0.02

    def load(self, config: Config) -> float:
        return next(iter(self.jobs[trial_index(config)].true.values())).cpus

    def slowdowns(self, device: Slot, here: Sequence[Config], host_load: float) -> list[float]:
        dem = [self.jobs[trial_index(c)].true[device.gpu_type] for c in here]
        total = sum(d.compute for d in dem) / 100.0
        k = len(dem)
        out = []
        for d in dem:
            u = d.compute / 100.0
            out.append(max(1.0 + u * (total - u), total, host_load, 1.0) * (1.0 + self.interference * (k - 1)))
        return out


class AllTrials:
    """Every trial at once, each in the study of its profile key."""

    def __init__(self, jobs: Sequence[PackJob]) -> None:
        self.jobs = jobs

    def start(self) -> list[Ask]:
        return [Ask(j.id, Config.of({"trial": i}), STEPS, study_of(j), "sp") for i, j in enumerate(self.jobs)]

    def on_result(self, tag: object, step: int, metrics: dict[str, float]) -> list[Ask]:
        return []


def study_of(job: PackJob) -> str:
    return f"{job.key[0]}-{job.key[1]}"


def placement_policies(policy: str, demand: Demand, oversub: float) -> dict[str, object]:
    """A study's ``policies``: HyperSack's ``policy`` with the demand its Sampler measured."""
    params = {"compute": demand.compute, "memory_bytes": demand.memory * GB, "cpus": demand.cpus, "oversub": oversub}
    return {"placement": policy, "placement_params": params}


@dataclass(frozen=True)
class PackRun:
    policy: str
    makespan: float
    requeued: int
    report: SimReport


def run_packing(
    jobs: Sequence[PackJob],
    slots: Sequence[Slot],
    policy: str,
    seen: Mapping[str, PackItem],
    oversub: float = 3.0,
    faults: Sequence[Fault] = (),
    checkpoint_every_s: float = 300.0,
) -> PackRun:
    """Every trial to completion under the placement ``policy`` through the live scheduling round; the
    studies declare the A100 demands of ``seen`` (the Sampler's profiles), the trials run the true ones."""
    policies: dict[str, StudyPolicies] = {}
    for j in jobs:
        policies.setdefault(study_of(j), parse_policies(placement_policies(policy, seen[j.id].demand["a100"], oversub)))
    everything = list(slots) + [s for f in faults if f.kind == "add" for s in f.slots]
    sim = Simulator(
        AllTrials(jobs),
        slots,
        workload=PackWorkload(jobs),
        policies=policies,
        contention=PackContention(jobs),
        host_capacity=host_cores(everything),
        faults=faults,
        peripheral_every_s=checkpoint_every_s,
        decision_cost=lambda st: _believed_runtime(sim, seen, jobs, st),
    )
    report = sim.run()
    return PackRun(policy, report.makespan, report.lost_batches, report)


def _believed_runtime(sim: Simulator, seen: Mapping[str, PackItem], jobs: Sequence[PackJob], st: Stage) -> float:
    """The Sampler's run time of the stage's trial on an A100, for its share of the trial's steps."""
    cfg = sim.by_id[st.plan].plan.nodes[st.node].config
    return seen[jobs[trial_index(cfg)].id].demand["a100"].runtime_s * (st.end - st.start) / STEPS
