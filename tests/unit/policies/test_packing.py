"""HyperSack: the placement policies against constraints (1)-(4), the exact solver against brute force,
the Sampler, and packing studies through the live round on the simulator with elasticity and failures
(``tests.sim.papers.hypersack``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.errors import InvalidArgument, NotFound, ResourceExhausted
from stagetree.core.policies.packing import (
    PLACE_POLICIES,
    Demand,
    GpuBin,
    PackItem,
    ProfileBook,
    Sample,
    Usage,
    demand_from_sample,
    exact_place,
    fits,
    occupancy,
    place,
)
from stagetree.core.simulator import Fault
from stagetree.core.slots import Slot
from tests.sim.papers.hypersack import PackJob, a100_slots, estimates, run_packing, sp_workload


def item(
    i: str, compute: float, memory: float = 1.0, cpus: float = 1.0, runtime: float = 100.0, t: str = "a100"
) -> PackItem:
    return PackItem(i, {t: Demand(compute, memory, cpus, runtime)})


def gpu(i: str, node: str = "n0", oversub: float = 1.0, memory: float = 80.0, t: str = "a100") -> GpuBin:
    return GpuBin(Slot(i, node, t), memory, oversub)


def test_first_fit_and_worst_fit_by_hand() -> None:
    gpus = [gpu("g0"), gpu("g1")]
    nodes = {"n0": 64.0}
    items = [item("a", 60, runtime=10), item("b", 30, runtime=50), item("c", 50, runtime=30)]
    # ff in grid order: a -> g0 (60), b -> g0 (90), c -> g1
    assert place("ff", items, gpus, nodes) == {"a": "g0", "b": "g0", "c": "g1"}
    # wf: a -> g0; b -> g1 (100 left there vs 40); c -> g1 (70 left vs 40)
    assert place("wf", items, gpus, nodes) == {"a": "g0", "b": "g1", "c": "g1"}
    # decreasing run time: b (50), c (30), a (10). ffd: b, c -> g0 (80), a -> g1; wfd: b -> g0, c -> g1, a -> g0
    assert place("ffd", items, gpus, nodes) == {"b": "g0", "c": "g0", "a": "g1"}
    assert place("wfd", items, gpus, nodes) == {"b": "g0", "c": "g1", "a": "g0"}
    assert place("one_per_gpu", items, gpus, nodes) == {"a": "g0", "b": "g1"}
    with pytest.raises(InvalidArgument, match="known"):
        place("best_fit", items, gpus, nodes)


def test_memory_cpu_and_oversubscription_bind() -> None:
    nodes = {"n0": 4.0}
    two = [gpu("g0", oversub=2.0), gpu("g1", oversub=2.0)]
    # oversubscription 2: three 60% trials fit one GPU's 200%; the fourth goes to the other
    assert sorted(place("ff", [item(f"t{i}", 60) for i in range(4)], two, {"n0": 64.0}).values()) == ["g0"] * 3 + ["g1"]
    # 4 node cores: at most four one-core trials on the node, whatever the GPUs could take
    assert len(place("wf", [item(f"t{i}", 10) for i in range(6)], two, nodes)) == 4
    # memory: 50 GB trials on 80 GB GPUs, one per GPU
    assert len(place("ff", [item(f"t{i}", 10, memory=50) for i in range(4)], two, {"n0": 64.0})) == 2


types = st.sampled_from(["a100", "h100"])


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[PackItem], list[GpuBin], dict[str, float]]:
    n_nodes = draw(st.integers(1, 3))
    gpus = []
    for n in range(n_nodes):
        for k in range(draw(st.integers(1, 3))):
            gpus.append(
                gpu(
                    f"g{n}{k}",
                    f"n{n}",
                    draw(st.sampled_from([1.0, 2.0, 3.0])),
                    draw(st.sampled_from([16.0, 80.0])),
                    draw(types),
                )
            )
    nodes = {f"n{n}": draw(st.sampled_from([4.0, 16.0, 88.0])) for n in range(n_nodes)}
    items = []
    for i in range(draw(st.integers(0, 24))):
        dem = {}
        for t in draw(st.sets(types, min_size=1)):
            dem[t] = Demand(
                draw(st.integers(5, 100)), draw(st.integers(1, 40)), draw(st.integers(1, 8)), draw(st.integers(1, 1000))
            )
        items.append(PackItem(f"i{i}", dem))
    return items, gpus, nodes


def check(assignment: dict[str, str], items: list[PackItem], gpus: list[GpuBin], nodes: dict[str, float]) -> None:
    by_id = {i.id: i for i in items}
    usage = Usage()
    by_slot = {g.slot.id: g for g in gpus}
    for i, s in assignment.items():  # (1): a dict gives each item at most one GPU
        g = by_slot[s]
        assert fits(by_id[i], g, nodes, usage), (i, s)  # (2)-(4) hold at every addition
        usage.add(by_id[i], g)


@settings(max_examples=60, deadline=None)
@given(instances(), st.sampled_from(sorted(PLACE_POLICIES)))
def test_placement_never_violates_capacity(
    inst: tuple[list[PackItem], list[GpuBin], dict[str, float]], policy: str
) -> None:
    items, gpus, nodes = inst
    out = place(policy, items, gpus, nodes)
    check(out, items, gpus, nodes)
    if policy == "one_per_gpu":
        assert len(set(out.values())) == len(out)


def brute_force(items: list[PackItem], gpus: list[GpuBin], nodes: dict[str, float]) -> float:
    best = 0.0
    for choice in itertools.product([None, *gpus], repeat=len(items)):
        usage = Usage()
        value = 0.0
        for it, g in zip(items, choice, strict=True):
            if g is None:
                continue
            if not fits(it, g, nodes, usage):
                break
            usage.add(it, g)
            value += it.on(g.slot.gpu_type).compute
        else:
            best = max(best, value)
    return best


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(10, 90), st.integers(1, 60), st.integers(1, 4)), min_size=0, max_size=6),
    st.integers(1, 3),
    st.sampled_from([1.0, 2.0]),
    st.sampled_from([3.0, 8.0]),
)
def test_exact_is_optimal_and_bounds_the_heuristics(
    spec: list[tuple[int, int, int]], n_gpus: int, oversub: float, cores: float
) -> None:
    items = [item(f"i{k}", float(c), float(m), float(q)) for k, (c, m, q) in enumerate(spec)]
    gpus = [gpu(f"g{k}", f"n{k % 2}", oversub) for k in range(n_gpus)]
    nodes = {"n0": cores, "n1": cores}
    ex = exact_place(items, gpus, nodes)
    check(ex, items, gpus, nodes)
    placed = sum(i.on("a100").compute for i in items if i.id in ex)
    assert placed == pytest.approx(brute_force(items, gpus, nodes))
    for p in PLACE_POLICIES:
        assert occupancy(place(p, items, gpus, nodes), items, gpus) <= occupancy(ex, items, gpus) + 1e-9


def test_exact_gives_up_loudly() -> None:
    items = [item(f"i{k}", float(17 + 3 * k % 41)) for k in range(30)]
    with pytest.raises(ResourceExhausted):
        exact_place(items, [gpu(f"g{k}") for k in range(4)], {"n0": 999.0}, max_nodes=50)


def test_sampler_drops_the_set_up_iteration_and_keeps_history() -> None:
    s = Sample(utilization=[5.0, 30.0, 34.0], seconds=[3.0, 0.2, 0.3], peak_memory=4.0, cpus=2.0, iterations=1000)
    d = demand_from_sample(s)
    assert d == Demand(32.0, 4.0, 2.0, pytest.approx(250.0))  # mean(0.2, 0.3) * 1000
    book = ProfileBook()
    assert book.missing([("resnet18", 64), ("resnet18", 64)], ["a100", "h100"]) == [
        (("resnet18", 64), "a100"),
        (("resnet18", 64), "h100"),
    ]
    book.record(("resnet18", 64), "a100", s)
    assert book.missing([("resnet18", 64)], ["a100"]) == []
    assert book.item("t1", ("resnet18", 64), ["a100"]).on("a100").compute == 32.0
    with pytest.raises(NotFound):
        book.item("t1", ("resnet18", 64), ["h100"])
    with pytest.raises(InvalidArgument):
        demand_from_sample(Sample([5.0], [1.0], 1.0, 1.0, 10))


def small_jobs(seed: int) -> list[PackJob]:
    return sp_workload(n_lr=1, seed=seed, models=("shufflenet", "resnet18", "resnet34"))


def test_packing_beats_one_per_gpu_on_light_jobs() -> None:
    jobs = small_jobs(0)
    base = run_packing(jobs, a100_slots(2), "one_per_gpu", estimates(jobs))
    wfd = run_packing(jobs, a100_slots(2), "wfd", estimates(jobs))
    assert len(base.report.served_at) == len(wfd.report.served_at) == len(jobs)
    assert wfd.makespan < base.makespan / 1.5


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 100),
    policy=st.sampled_from(sorted(PLACE_POLICIES)),
    events=st.lists(
        st.tuples(st.floats(0.0, 3000.0), st.sampled_from(["crash", "lose", "add"]), st.integers(0, 2)), max_size=4
    ),
)
def test_every_trial_completes_through_failures_and_elasticity(
    seed: int, policy: str, events: list[tuple[float, str, int]]
) -> None:
    jobs = small_jobs(seed)
    slots = a100_slots(3)
    gpu = {k: tuple(s for s in slots if s.id.startswith(f"a{k}.")) for k in range(3)}
    spare = {k: tuple(a100_slots(1, first=4 + k)) for k in range(3)}
    faults, alive, added = [], set(gpu), set()
    for t, kind, k in sorted(events):
        if kind == "add" and k not in added:
            faults.append(Fault(t, "add", spare[k]))
            added.add(k)
        elif kind != "add" and k in alive and len(alive) > 1:  # keep at least one GPU
            faults.append(Fault(t, kind, gpu[k]))
            if kind == "lose":
                alive.discard(k)
    run = run_packing(jobs, slots, policy, estimates(jobs), faults=faults)
    assert len(run.report.served_at) == len(jobs)
    assert run.report.duplicate_steps >= 0
    if not any(f.kind in ("crash", "lose") for f in faults):
        assert run.report.lost_batches == 0 and run.report.executed_steps == run.report.unique_steps
    # A GPU is never more than 100% busy, and at most 6 GPUs are ever up: the busy time bounds the makespan.
    busy = sum(j.true["a100"].runtime_s * j.true["a100"].compute / 100.0 for j in jobs)
    assert run.makespan >= busy / 6 - 1e-6
