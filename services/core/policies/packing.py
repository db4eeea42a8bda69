"""HyperSack (Alnaasan et al., 2024): packing several trials on one GPU, as a pure Place step.

The GPU Assignment Problem (§III): put trials on GPUs so that on every GPU the summed compute demand
stays within its capacity scaled by the oversubscription ratio (2), the summed memory within its
memory (3), and on every node the summed CPU cores within the node's cores (4); each trial on at most
one GPU (1); maximize the compute placed (5). Demands are *per GPU type* (a trial uses less of an H100
than of an A100), so heterogeneous clusters need nothing special.

Policies (Alg. 1-2), each one pass over the pending trials in order:

* ``ff``: the first GPU (nodes, then GPUs, in cluster order) where the trial fits;
* ``ffd``: ``ff`` over the trials sorted by expected run time, longest first;
* ``wf``: the GPU with the most compute capacity left where the trial fits (balances load);
* ``wfd``: ``wf`` over the trials sorted by expected run time, longest first;
* ``one_per_gpu``: the baseline, a GPU runs one trial at a time (the usual HPO parallelization).

``exact_place`` solves small instances exactly (branch and bound over the multiple-knapsack problem) so
the heuristics' occupancy can be compared with the optimum (Table III).

``ProfileBook`` is the Sampler (§IV-C1): a trial's demand on a GPU type comes from the job history when
that (model, batch size, GPU type) ran before, else from a short profiling run (10 iterations, the first
discarded as set-up).

Plug-in interface for the master's Place step::

    assignment = place("wfd", items, gpus, nodes, usage)   # -> {item id: slot id}; items not placed wait
    usage.add(item, gpu)  / usage.remove(item, gpu)      # keep the running trials' demands accounted
    usage.drop_gpu(slot_id)                               # elasticity / failure: the GPU's trials re-queue

``gpus`` are ``GpuBin(slot, memory, oversub, compute)`` with ``slot`` the scheduler's ``Slot`` (its
``node_manager`` is the node, its ``gpu_type`` picks the demand); ``nodes`` maps a node to its CPU cores.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from stagetree.core.errors import InvalidArgument, NotFound, ResourceExhausted
from stagetree.core.slots import Slot

EPS = 1e-9


@dataclass(frozen=True)
class Demand:
    """What a trial needs on one GPU type: compute (% of the GPU, its utilization running alone),
    peak memory, CPU cores, and its expected run time alone."""

    compute: float
    memory: float
    cpus: float
    runtime_s: float


@dataclass(frozen=True)
class PackItem:
    id: str
    demand: Mapping[str, Demand]  # GPU type -> demand there

    def on(self, gpu_type: str) -> Demand:
        d = self.demand.get(gpu_type)
        if d is None:
            raise NotFound(f"trial {self.id!r} has no profile for GPU type {gpu_type!r}; profile it first")
        return d

    @property
    def expected_runtime(self) -> float:
        """The sort key of the decreasing policies: the longest run time over the GPU types profiled."""
        return max(d.runtime_s for d in self.demand.values())


@dataclass(frozen=True)
class GpuBin:
    """A GPU: its slot, memory ``D``, oversubscription ratio ``r`` and compute capacity ``C`` (100%)."""

    slot: Slot
    memory: float
    oversub: float = 1.0
    compute: float = 100.0

    @property
    def capacity(self) -> float:
        return self.oversub * self.compute


@dataclass
class Usage:
    """What is placed already: compute and memory per GPU, CPU cores per node, trials per GPU."""

    compute: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    cpus: dict[str, float] = field(default_factory=dict)
    items: dict[str, list[str]] = field(default_factory=dict)

    def add(self, item: PackItem, gpu: GpuBin) -> None:
        d = item.on(gpu.slot.gpu_type)
        sid = gpu.slot.id
        self.compute[sid] = self.compute.get(sid, 0.0) + d.compute
        self.memory[sid] = self.memory.get(sid, 0.0) + d.memory
        node = gpu.slot.node_manager
        self.cpus[node] = self.cpus.get(node, 0.0) + d.cpus
        self.items.setdefault(sid, []).append(item.id)

    def remove(self, item: PackItem, gpu: GpuBin) -> None:
        d = item.on(gpu.slot.gpu_type)
        sid = gpu.slot.id
        self.items[sid].remove(item.id)
        self.compute[sid] -= d.compute
        self.memory[sid] -= d.memory
        self.cpus[gpu.slot.node_manager] -= d.cpus

    def drop_gpu(self, gpu: GpuBin, items: Mapping[str, PackItem]) -> list[str]:
        """The GPU left (removed or failed): forget its trials and return them, to be re-queued."""
        gone = list(self.items.get(gpu.slot.id, ()))
        for i in gone:
            self.remove(items[i], gpu)
        self.items.pop(gpu.slot.id, None)
        return gone

    def count(self, gpu: GpuBin) -> int:
        return len(self.items.get(gpu.slot.id, ()))


def fits(item: PackItem, gpu: GpuBin, nodes: Mapping[str, float], usage: Usage) -> bool:
    """Constraints (2)-(4) for adding ``item`` to ``gpu``."""
    d = item.demand.get(gpu.slot.gpu_type)
    if d is None:
        return False
    sid, node = gpu.slot.id, gpu.slot.node_manager
    return (
        usage.compute.get(sid, 0.0) + d.compute <= gpu.capacity + EPS
        and usage.memory.get(sid, 0.0) + d.memory <= gpu.memory + EPS
        and usage.cpus.get(node, 0.0) + d.cpus <= nodes.get(node, 0.0) + EPS
    )


def _left(gpu: GpuBin, usage: Usage) -> float:
    return gpu.capacity - usage.compute.get(gpu.slot.id, 0.0)


def _first_fit(item: PackItem, gpus: Sequence[GpuBin], nodes: Mapping[str, float], usage: Usage) -> GpuBin | None:
    return next((g for g in gpus if fits(item, g, nodes, usage)), None)


def _worst_fit(item: PackItem, gpus: Sequence[GpuBin], nodes: Mapping[str, float], usage: Usage) -> GpuBin | None:
    best: GpuBin | None = None
    for g in gpus:
        if fits(item, g, nodes, usage) and (best is None or _left(g, usage) > _left(best, usage) + EPS):
            best = g
    return best


def _one_per_gpu(item: PackItem, gpus: Sequence[GpuBin], nodes: Mapping[str, float], usage: Usage) -> GpuBin | None:
    return next((g for g in gpus if usage.count(g) == 0 and fits(item, g, nodes, usage)), None)


Chooser = Callable[[PackItem, Sequence[GpuBin], Mapping[str, float], Usage], GpuBin | None]


@dataclass(frozen=True)
class PlacePolicy:
    name: str
    choose: Chooser
    decreasing: bool


PLACE_POLICIES: Mapping[str, PlacePolicy] = {
    p.name: p
    for p in (
        PlacePolicy("ff", _first_fit, False),
        PlacePolicy("ffd", _first_fit, True),
        PlacePolicy("wf", _worst_fit, False),
        PlacePolicy("wfd", _worst_fit, True),
        PlacePolicy("one_per_gpu", _one_per_gpu, False),
    )
}


def place_policy(name: str) -> PlacePolicy:
    pol = PLACE_POLICIES.get(name)
    if pol is None:
        raise InvalidArgument(f"unknown placement policy {name!r}; known: {sorted(PLACE_POLICIES)}")
    return pol


def place(
    policy: str | PlacePolicy,
    items: Sequence[PackItem],
    gpus: Sequence[GpuBin],
    nodes: Mapping[str, float],
    usage: Usage | None = None,
) -> dict[str, str]:
    """One scheduling decision: item id -> slot id for the items that fit now; ``usage`` is updated."""
    pol = place_policy(policy) if isinstance(policy, str) else policy
    usage = usage if usage is not None else Usage()
    order = sorted(items, key=lambda i: -i.expected_runtime) if pol.decreasing else list(items)
    out: dict[str, str] = {}
    for item in order:
        g = pol.choose(item, gpus, nodes, usage)
        if g is not None:
            usage.add(item, g)
            out[item.id] = g.slot.id
    return out


def occupancy(assignment: Mapping[str, str], items: Sequence[PackItem], gpus: Sequence[GpuBin]) -> float:
    """Placed compute over the total (oversubscribed) compute capacity: the objective (5), normalized."""
    by_slot = {g.slot.id: g for g in gpus}
    by_id = {i.id: i for i in items}
    placed = sum(by_id[i].on(by_slot[s].slot.gpu_type).compute for i, s in assignment.items())
    total = sum(g.capacity for g in gpus)
    return placed / total if total else 0.0


def exact_place(
    items: Sequence[PackItem], gpus: Sequence[GpuBin], nodes: Mapping[str, float], max_nodes: int = 2_000_000
) -> dict[str, str]:
    """The assignment maximizing the placed compute (5) under (1)-(4), by depth-first branch and bound.

    Items go largest first; each is tried on every GPU it fits (tightest first; GPUs whose whole
    situation is interchangeable are tried once) and then left out, with the rest of its identical kind.
    A branch stops when even the best
    subset of the remaining items that fits in the capacity left in total (a subset-sum bound, exact
    when demands are whole percentages, as NVML reports them) cannot beat the best so far. Meant for
    the small instances of a quality check: past ``max_nodes`` search nodes it raises
    ``ResourceExhausted``.
    """

    def shape(i: PackItem) -> tuple[object, ...]:
        return tuple(sorted((t, d.compute, d.memory, d.cpus) for t, d in i.demand.items()))

    order = sorted(items, key=lambda i: (-max(d.compute for d in i.demand.values()), shape(i)))
    size = [max(d.compute for d in i.demand.values()) for i in order]
    # next_kind[k]: the first item after k that differs from it. Identical items are interchangeable, so
    # leaving item k out means leaving out the rest of its kind too (the placed ones are the first few).
    next_kind = [len(order)] * len(order)
    for k in range(len(order) - 2, -1, -1):
        next_kind[k] = next_kind[k + 1] if shape(order[k]) == shape(order[k + 1]) else k + 1
    integral = all(abs(c - round(c)) < 1e-9 for c in size) and all(
        abs(g.capacity - round(g.capacity)) < 1e-9 for g in gpus
    )
    rest = [0.0] * (len(order) + 1)
    for k in range(len(order) - 1, -1, -1):
        rest[k] = rest[k + 1] + size[k]
    reach = [1] * (len(order) + 1)  # bit s set: some subset of items k.. sums to s
    if integral:
        limit = (1 << (round(sum(g.capacity for g in gpus)) + 1)) - 1
        for k in range(len(order) - 1, -1, -1):
            reach[k] = (reach[k + 1] | (reach[k + 1] << round(size[k]))) & limit
    usage = Usage()
    best_value = -1.0
    best: dict[str, str] = {}
    current: dict[str, str] = {}
    visited = 0

    def best_sum(k: int, room: float) -> int:
        """The largest sum of a subset of items k.. not above ``room``."""
        return (reach[k] & ((1 << (math.floor(room + 1e-9) + 1)) - 1)).bit_length() - 1

    def bound(k: int, value: float) -> float:
        rooms = [max(_left(g, usage), 0.0) for g in gpus]
        if integral:  # every GPU filled as well as the remaining items allow, and all of them together
            return value + min(best_sum(k, sum(rooms)), sum(best_sum(k, r) for r in rooms))
        return value + min(rest[k], sum(rooms))

    def signature(g: GpuBin) -> tuple[object, ...]:
        node = g.slot.node_manager
        peers = tuple(
            sorted(
                (p.slot.gpu_type, p.capacity, p.memory, round(usage.compute.get(p.slot.id, 0.0), 9))
                for p in gpus
                if p.slot.node_manager == node
            )
        )
        return (
            g.slot.gpu_type,
            g.capacity,
            g.memory,
            round(usage.compute.get(g.slot.id, 0.0), 9),
            round(usage.memory.get(g.slot.id, 0.0), 9),
            nodes.get(node, 0.0) - usage.cpus.get(node, 0.0),
            peers,
        )

    def dfs(k: int, value: float) -> None:
        nonlocal best_value, best, visited
        visited += 1
        if visited > max_nodes:
            raise ResourceExhausted(f"exact_place: more than {max_nodes} search nodes; use a smaller instance")
        if value > best_value + EPS:
            best_value, best = value, dict(current)
        if k == len(order):
            return
        top = bound(k, value)
        if top <= best_value + EPS:
            return
        item = order[k]
        tried: set[tuple[object, ...]] = set()
        for g in sorted(gpus, key=lambda g: _left(g, usage)):
            if not fits(item, g, nodes, usage):
                continue
            sig = signature(g)
            if sig in tried:
                continue
            tried.add(sig)
            usage.add(item, g)
            current[item.id] = g.slot.id
            dfs(k + 1, value + item.on(g.slot.gpu_type).compute)
            del current[item.id]
            usage.remove(item, g)
            if best_value >= top - EPS:
                return  # the bound is reached: nothing in this branch can do better
        dfs(next_kind[k], value)

    dfs(0, 0.0)
    return best


# ---------------------------------------------------------------------------------------------
# The Sampler


@dataclass(frozen=True)
class Sample:
    """One profiling run on one GPU type: per-iteration utilization (%) and seconds, peak memory, CPU
    cores used, and how many iterations the whole run has."""

    utilization: Sequence[float]
    seconds: Sequence[float]
    peak_memory: float
    cpus: float
    iterations: int


def demand_from_sample(sample: Sample) -> Demand:
    """The first iteration is set-up and is dropped (HyperSack §IV-C1); the rest are averaged and the
    run time is extrapolated from the time per iteration."""
    if len(sample.utilization) < 2 or len(sample.seconds) != len(sample.utilization):
        raise InvalidArgument("demand_from_sample: need at least two profiled iterations with times and utilization")
    util = sample.utilization[1:]
    secs = sample.seconds[1:]
    per_iter = sum(secs) / len(secs)
    return Demand(sum(util) / len(util), sample.peak_memory, sample.cpus, per_iter * sample.iterations)


@dataclass
class ProfileBook:
    """Per (profile key, GPU type) demands: the job history, filled by profiling runs.

    The key is what determines the cost (HyperSack: model, optimizer, batch size), e.g.
    ``("resnet18", 128)``. ``missing`` says which (key, GPU type) pairs still need a profiling run.
    """

    history: dict[tuple[object, str], Demand] = field(default_factory=dict)

    def missing(self, keys: Sequence[object], gpu_types: Sequence[str]) -> list[tuple[object, str]]:
        seen: set[tuple[object, str]] = set()
        out = []
        for k in keys:
            for t in gpu_types:
                if (k, t) not in self.history and (k, t) not in seen:
                    seen.add((k, t))
                    out.append((k, t))
        return out

    def record(self, key: object, gpu_type: str, sample: Sample) -> Demand:
        d = demand_from_sample(sample)
        self.history[(key, gpu_type)] = d
        return d

    def item(self, item_id: str, key: object, gpu_types: Sequence[str]) -> PackItem:
        """A trial's demands on the given GPU types from the history (``NotFound`` if one is missing)."""
        demand = {}
        for t in gpu_types:
            d = self.history.get((key, t))
            if d is None:
                raise NotFound(f"no profile for {key!r} on {t!r}; run the sampler first")
            demand[t] = d
        return PackItem(item_id, demand)
