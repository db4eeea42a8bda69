"""An event-driven simulator of trials packed on shared GPUs (HyperSack §V), with elasticity and failures.

Trials placed on one GPU run concurrently (MPS). A trial alone on a GPU type takes ``runtime_s`` and
keeps that GPU busy a fraction ``u = compute / 100`` of the time (the rest is data loading on the CPU).
Co-located, trial ``j`` slows down by

    max(1 + u_j * (U - u_j),   U,   cpus_node / Q_node) * (1 + interference * (k - 1))

where ``U`` sums ``u`` over the ``k`` trials on its GPU: its GPU phases meet the others' in proportion
to their busy fractions; a saturated GPU (``U > 1``) shares out exactly its capacity; an oversubscribed
node's CPUs stretch the data loading; and each co-runner adds a little context-switching overhead. So
packing pays while the GPU has idle bubbles, and oversubscribing too far costs.

The placement policy sees *estimated* demands (the Sampler's profiles), the simulation runs the true
ones. At every completion or cluster change the policy places pending trials with the usage the running
trials hold. A GPU may be added, removed (its trials checkpoint and re-queue with their progress) or fail
(its trials re-queue from their last periodic checkpoint, losing the work since).

``sp_workload`` builds HyperSack's search spaces (Table II): six lightweight vision models x four batch
sizes x four learning rates = 96 trials (SP1), with utilization under 50% on an A100.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.packing import Demand, GpuBin, PackItem, Usage, place, place_policy
from stagetree.core.slots import Slot


@dataclass(frozen=True)
class PackJob:
    """A trial: its profile key (model, batch size), its true demands per GPU type, its grid position."""

    id: str
    key: tuple[str, int]
    true: Mapping[str, Demand]


@dataclass(frozen=True)
class ClusterChange:
    time: float
    kind: str  # "add" | "remove" | "fail"
    gpu: GpuBin


@dataclass(frozen=True)
class PackRun:
    policy: str
    makespan: float
    completed: int
    requeued: int
    lost_work_s: float
    busy: float  # time-averaged sum of u over GPUs, per GPU (the GPUs' occupancy)


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


def a100_cluster(
    n_gpus: int, oversub: float = 3.0, per_node: int = 4, cores: float = 88.0
) -> tuple[list[GpuBin], dict[str, float]]:
    """``n_gpus`` A100s (80 GB), ``per_node`` per node with ``cores`` CPU cores (HyperSack's A100 nodes)."""
    gpus = [GpuBin(Slot(f"a{i}", f"na{i // per_node}", "a100"), 80.0, oversub) for i in range(n_gpus)]
    nodes = {g.slot.node_manager: cores for g in gpus}
    return gpus, nodes


def h100_cluster(
    n_gpus: int, oversub: float = 2.5, per_node: int = 2, cores: float = 96.0
) -> tuple[list[GpuBin], dict[str, float]]:
    gpus = [GpuBin(Slot(f"h{i}", f"nh{i // per_node}", "h100"), 80.0, oversub) for i in range(n_gpus)]
    nodes = {g.slot.node_manager: cores for g in gpus}
    return gpus, nodes


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


@dataclass
class _Run:
    job: str
    gpu: GpuBin
    started: float
    rate: float = 0.0  # fraction of the whole trial done per second


def _rates(
    running: Mapping[str, _Run], true: Mapping[str, PackJob], nodes: Mapping[str, float], interference: float
) -> None:
    by_gpu: dict[str, list[_Run]] = {}
    cpus: dict[str, float] = {}
    for r in running.values():
        by_gpu.setdefault(r.gpu.slot.id, []).append(r)
        node = r.gpu.slot.node_manager
        cpus[node] = cpus.get(node, 0.0) + true[r.job].true[r.gpu.slot.gpu_type].cpus
    for runs in by_gpu.values():
        t = runs[0].gpu.slot.gpu_type
        dem = [true[r.job].true[t] for r in runs]
        total = sum(d.compute for d in dem) / 100.0
        k = len(runs)
        node = runs[0].gpu.slot.node_manager
        cpu_load = cpus[node] / nodes[node] if nodes.get(node) else 1.0
        for r, d in zip(runs, dem, strict=True):
            u = d.compute / 100.0
            slow = max(1.0 + u * (total - u), total, cpu_load, 1.0) * (1.0 + interference * (k - 1))
            r.rate = 1.0 / (slow * d.runtime_s)


def simulate_packing(
    jobs: Sequence[PackJob],
    gpus: Sequence[GpuBin],
    nodes: Mapping[str, float],
    policy: str,
    seen: Mapping[str, PackItem] | None = None,
    changes: Sequence[ClusterChange] = (),
    interference: float = 0.02,
    checkpoint_every_s: float = 300.0,
    start_s: float = 0.0,
) -> PackRun:
    """Run every trial to completion; ``seen`` are the demands the policy believes (default: the truth).

    ``start_s`` delays the first placement (the Sampler's profiling runs).
    """
    pol = place_policy(policy)
    true = {j.id: j for j in jobs}
    if len(true) != len(jobs):
        raise InvalidArgument("simulate_packing: job ids must be unique")
    believed = dict(seen) if seen is not None else {j.id: PackItem(j.id, j.true) for j in jobs}
    alive: list[GpuBin] = list(gpus)
    all_nodes = dict(nodes)
    for c in changes:
        all_nodes.setdefault(c.gpu.slot.node_manager, 0.0)
    pending: list[str] = [j.id for j in jobs]
    left = {j.id: 1.0 for j in jobs}  # fraction of each trial still to run
    running: dict[str, _Run] = {}
    usage = Usage()
    todo = sorted(changes, key=lambda c: c.time)
    now = start_s
    completed = requeued = 0
    lost = 0.0
    busy_area = gpu_area = 0.0

    def dispatch() -> None:
        items = [believed[j] for j in pending]
        by_slot = {g.slot.id: g for g in alive}
        for job, sid in place(pol, items, alive, all_nodes, usage).items():
            running[job] = _Run(job, by_slot[sid], now)
            pending.remove(job)
        _rates(running, true, all_nodes, interference)

    def requeue(gpu: GpuBin, failed: bool) -> None:
        nonlocal requeued, lost
        for job in usage.drop_gpu(gpu, believed):
            r = running.pop(job)
            if failed:  # back to the last periodic checkpoint: the progress since it is lost
                redo = min(((now - r.started) % checkpoint_every_s) * r.rate, 1.0 - left[job])
                left[job] += redo
                lost += redo * true[job].true[gpu.slot.gpu_type].runtime_s
            pending.insert(0, job)
            requeued += 1
        _rates(running, true, all_nodes, interference)

    while pending or running or todo:
        dispatch()
        nxt_done = min((now + left[r.job] / r.rate for r in running.values()), default=math.inf)
        nxt_change = todo[0].time if todo else math.inf
        t = max(min(nxt_done, nxt_change), now)
        if math.isinf(t):
            raise InvalidArgument(f"simulate_packing: {len(pending)} trials can never be placed on these GPUs")
        dt = t - now
        if alive:
            load: dict[str, float] = {}
            for r in running.values():
                load[r.gpu.slot.id] = load.get(r.gpu.slot.id, 0.0) + true[r.job].true[r.gpu.slot.gpu_type].compute
            busy_area += dt * sum(min(v / 100.0, 1.0) for v in load.values())
            gpu_area += dt * len(alive)
        for r in running.values():
            left[r.job] -= r.rate * dt
        now = t
        if nxt_change <= nxt_done:
            c = todo.pop(0)
            if c.kind == "add":
                alive.append(c.gpu)
            elif c.kind in ("remove", "fail"):
                alive = [g for g in alive if g.slot.id != c.gpu.slot.id]
                requeue(c.gpu, failed=c.kind == "fail")
            else:
                raise InvalidArgument(f"simulate_packing: unknown change {c.kind!r}; known: add, remove, fail")
            continue
        for job in [j for j in running if left[j] <= 1e-9]:
            r = running.pop(job)
            usage.remove(believed[job], r.gpu)
            left[job] = 0.0
            completed += 1
    return PackRun(pol.name, now, completed, requeued, lost, busy_area / gpu_area if gpu_area else 0.0)
