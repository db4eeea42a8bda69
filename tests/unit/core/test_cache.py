"""Checkpoint cache policy: hand-computed cases, and properties over random search plans checked with
the real SearchPlan and build_stage_tree."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.batch import Point
from stagetree.core.cache import (
    EvictionResult,
    choose_evictions,
    pinned_points,
    plan_evictions,
    prefix_cost,
    recompute_seconds,
)
from stagetree.core.config import Config
from stagetree.core.errors import InvalidArgument
from stagetree.core.searchplan import Checkpoint, CheckpointKind, SearchPlan
from stagetree.core.stagetree import StageForest, build_stage_tree

CFG = Config.of({"lr": 0.1})
NOW = 10_000.0


def ck(node: int, step: int, nbytes: int = 100, last_used: float = NOW) -> Checkpoint:
    return Checkpoint(Point(node, step), f"mem://{node}/{step}", nbytes, CheckpointKind.CENTRAL, last_used)


def tree_plan() -> SearchPlan:
    """Root 1; node 2 branches off it at step 10; node 3 branches off node 2 at step 15."""
    plan = SearchPlan("p")
    plan.add_node(None, 0, CFG, node_id=1)
    plan.add_node(1, 10, CFG, node_id=2)
    plan.add_node(2, 15, CFG, node_id=3)
    return plan


RATES = {1: 1.0, 2: 2.0, 3: 3.0}


# ---------------------------------------------------------------------------------------------
# Recompute costs


def test_prefix_cost_adds_each_stretch_at_its_own_nodes_rate() -> None:
    plan = tree_plan()
    f = prefix_cost(plan.nodes, RATES.__getitem__)
    assert f(Point(1, 0)) == 0.0
    assert f(Point(1, 7)) == 7.0
    assert f(Point(2, 12)) == 10 + 2 * 2
    assert f(Point(3, 20)) == 10 + 5 * 2 + 5 * 3
    assert prefix_cost(plan.nodes, 0.5)(Point(3, 20)) == 10.0
    with pytest.raises(InvalidArgument):
        f(Point(3, 14))  # before node 3's start
    with pytest.raises(InvalidArgument):
        f(Point(9, 1))  # unknown node
    with pytest.raises(InvalidArgument):
        prefix_cost(plan.nodes, -1.0)(Point(1, 3))


def test_recompute_seconds_counts_from_the_nearest_earlier_checkpoint_on_the_path() -> None:
    plan = tree_plan()
    rate = RATES.__getitem__
    assert recompute_seconds(plan, Point(3, 20), rate) == 35.0  # no checkpoint: from scratch
    plan.record_checkpoint(ck(1, 5))
    assert recompute_seconds(plan, Point(3, 20), rate) == 30.0
    assert recompute_seconds(plan, Point(1, 5), rate) == 5.0  # its own checkpoint does not count
    plan.record_checkpoint(ck(1, 10))  # the branch point of node 2
    assert recompute_seconds(plan, Point(3, 20), rate) == 25.0
    assert recompute_seconds(plan, Point(2, 10), rate) == 5.0  # canonical (1, 10): from (1, 5)
    plan.record_checkpoint(ck(2, 13))
    assert recompute_seconds(plan, Point(3, 20), rate) == 2 * 2 + 5 * 3
    plan.record_checkpoint(ck(1, 12))  # on node 1 past the branch: not on node 3's path
    assert recompute_seconds(plan, Point(3, 20), rate) == 19.0
    assert recompute_seconds(plan, Point(1, 20), rate) == 8.0


# ---------------------------------------------------------------------------------------------
# Hand-computed eviction cases


def steps_cost(point: Point) -> float:
    return float(point.step)


def test_nothing_is_evicted_under_budget() -> None:
    r = choose_evictions([ck(1, 10), ck(1, 20)], 200, pinned=set(), recompute_cost=steps_cost, now=NOW)
    assert r == EvictionResult([], 200, 0)


def test_evicting_a_checkpoint_makes_the_later_ones_on_its_path_dearer() -> None:
    # Values start equal (10 s / 100 B each); ties go to the smaller point, so (1, 10) goes first.
    # (1, 20) must then be recomputed from scratch (20 s): its value doubles and (1, 30) goes next.
    # A policy that did not re-evaluate would drop (1, 20) and leave a 30-step gap.
    cks = [ck(1, 10), ck(1, 20), ck(1, 30)]
    r = choose_evictions(cks, 100, pinned=set(), recompute_cost=steps_cost, now=NOW)
    assert r.evict == [Point(1, 10), Point(1, 30)]
    assert (r.bytes_after, r.shortfall) == (100, 0)


def test_cost_per_byte_decides() -> None:
    # (1, 10): 10 s for 1000 B = 0.01 s/B; (1, 20): 10 s for 100 B = 0.1 s/B.
    r = choose_evictions([ck(1, 10, nbytes=1000), ck(1, 20)], 500, pinned=set(), recompute_cost=steps_cost, now=NOW)
    assert r == EvictionResult([Point(1, 10)], 100, 0)


def test_value_halves_per_half_life_since_last_use() -> None:
    # Two roots. (1, 30): 30/100 * 0.5**2 = 0.075 < (2, 10): 10/100 = 0.1, though it costs 3x more.
    old = ck(1, 30, last_used=NOW - 200)
    fresh = ck(2, 10)
    r = choose_evictions([old, fresh], 100, pinned=set(), recompute_cost=steps_cost, now=NOW, half_life_s=100)
    assert r.evict == [Point(1, 30)]
    r = choose_evictions([old, fresh], 100, pinned=set(), recompute_cost=steps_cost, now=NOW, half_life_s=1e9)
    assert r.evict == [Point(2, 10)]


def test_lineage_across_nodes_comes_from_the_plans_nodes() -> None:
    plan = tree_plan()
    f = prefix_cost(plan.nodes, RATES.__getitem__)  # f(1, 8) = 8, f(2, 20) = 10 + 10*2 = 30
    cks = [ck(1, 8), ck(2, 20, nbytes=300)]
    # With the path known, (2, 20) costs 30 - 8 = 22 s: 22/300 < 8/100, so it goes.
    r = choose_evictions(cks, 300, pinned=set(), recompute_cost=f, now=NOW, nodes=plan.nodes)
    assert r == EvictionResult([Point(2, 20)], 100, 0)
    # Without it, (2, 20) is valued from scratch: 30/300 = 0.1 > 0.08, so (1, 8) goes.
    r = choose_evictions(cks, 300, pinned=set(), recompute_cost=f, now=NOW)
    assert r == EvictionResult([Point(1, 8)], 300, 0)


def test_pinned_are_kept_and_the_shortfall_reported() -> None:
    cks = [ck(1, 10, nbytes=300), ck(1, 20), ck(2, 5)]
    r = choose_evictions(cks, 100, pinned={Point(1, 10)}, recompute_cost=steps_cost, now=NOW)
    assert sorted(r.evict) == [Point(1, 20), Point(2, 5)]
    assert (r.bytes_after, r.shortfall) == (300, 200)
    r = choose_evictions(cks, 0, pinned={c.point for c in cks}, recompute_cost=steps_cost, now=NOW)
    assert r == EvictionResult([], 500, 500)


def test_empty_checkpoints_are_never_evicted() -> None:
    r = choose_evictions([ck(1, 10, nbytes=0), ck(1, 20)], 0, pinned=set(), recompute_cost=steps_cost, now=NOW)
    assert r == EvictionResult([Point(1, 20)], 0, 0)


def test_accepts_the_plans_checkpoint_mapping() -> None:
    plan = tree_plan()
    for c in (ck(1, 5), ck(2, 12), ck(3, 18)):
        plan.record_checkpoint(c)
    a = choose_evictions(
        plan.checkpoints, 150, pinned=set(), recompute_cost=prefix_cost(plan.nodes, 1.0), now=NOW, nodes=plan.nodes
    )
    b = plan_evictions(plan, 150, pinned=set(), seconds_per_step=1.0, now=NOW)
    assert a == b
    assert len(a.evict) == 2 and a.bytes_after == 100


@pytest.mark.parametrize(
    ("kwargs", "cks", "match"),
    [
        ({"budget_bytes": -1}, [ck(1, 1)], "budget_bytes"),
        ({"budget_bytes": True}, [ck(1, 1)], "budget_bytes"),
        ({"now": math.nan}, [ck(1, 1)], "now"),
        ({"half_life_s": 0.0}, [ck(1, 1)], "half_life_s"),
        ({}, [ck(1, 1), ck(1, 1)], "twice"),
        ({}, [ck(1, 1, nbytes=-5)], "bytes"),
        ({}, [ck(1, 1, last_used=math.inf)], "last_used"),
        ({"recompute_cost": lambda p: -1.0}, [ck(1, 1)], "recompute_cost"),
        ({"recompute_cost": lambda p: math.nan}, [ck(1, 1)], "recompute_cost"),
        ({"nodes": {}}, [ck(1, 1)], "unknown"),
        ({"nodes": tree_plan().nodes, "budget_bytes": 10**6}, [ck(2, 10)], "canonical"),
        ({"nodes": tree_plan().nodes}, [ck(3, 2)], "canonical"),
    ],
)
def test_bad_input_is_invalid_argument(kwargs: dict[str, object], cks: list[Checkpoint], match: str) -> None:
    args: dict[str, object] = {
        "budget_bytes": 0,
        "pinned": set(),
        "recompute_cost": steps_cost,
        "now": NOW,
    }
    args.update(kwargs)
    with pytest.raises(InvalidArgument, match=match):
        choose_evictions(cks, **args)  # type: ignore[arg-type]


def test_pinned_points_are_the_stage_sources_and_running_batches() -> None:
    plan = tree_plan()
    plan.record_checkpoint(ck(1, 5))
    plan.record_checkpoint(ck(2, 12))
    plan.record_checkpoint(ck(3, 18))
    forest = build_stage_tree(plan.nodes, plan.checkpoint_steps(), [(1, Point(2, 14)), (2, Point(1, 9))])
    assert pinned_points(forest) == {Point(2, 12), Point(1, 5)}
    assert pinned_points(forest, [Point(3, 18)]) == {Point(2, 12), Point(1, 5), Point(3, 18)}


# ---------------------------------------------------------------------------------------------
# Properties over random plans


@dataclass
class Scenario:
    plan: SearchPlan
    rates: dict[int, float]
    pending: list[tuple[int, Point]]
    pinned: set[Point]
    budget: int
    half_life: float


@st.composite
def points_on(draw: st.DrawFn, plan: SearchPlan, first: int = 0) -> Point:
    node = plan.nodes[draw(st.sampled_from(sorted(plan.nodes)))]
    if node.parent is None:
        return Point(node.id, draw(st.integers(first, 60)))
    return Point(node.id, node.start + draw(st.integers(1, 60)))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    plan = SearchPlan("p")
    rates: dict[int, float] = {}
    for i in range(1, draw(st.integers(1, 7)) + 1):
        if i == 1 or draw(st.integers(0, 4)) == 0:
            plan.add_node(None, 0, CFG, node_id=i)
        else:
            parent = plan.nodes[draw(st.integers(1, i - 1))]
            plan.add_node(parent.id, parent.start + draw(st.integers(1, 40)), CFG, node_id=i)
        rates[i] = draw(st.sampled_from([0.0, 0.25, 1.0, 3.0]))
    for _ in range(draw(st.integers(0, 12))):
        p = draw(points_on(plan))
        nbytes = draw(st.integers(0, 1000))
        plan.record_checkpoint(ck(p.node, p.step, nbytes, NOW - draw(st.integers(0, 5000))))
    # Requests at step >= 1: build_stage_tree drops a request at a root's step 0 (untrained model,
    # no checkpoint) when another request's walk reached that origin first (reported upstream).
    pending = [(rid, draw(points_on(plan, first=1))) for rid in range(1, draw(st.integers(0, 8)) + 1)]
    pinned = {p for p in plan.checkpoints if draw(st.integers(0, 3)) == 0}
    total = sum(c.bytes for c in plan.checkpoints.values())
    budget = draw(st.integers(0, total + 10))
    half_life = draw(st.sampled_from([1.0, 1000.0, 1e9]))
    return Scenario(plan, rates, pending, pinned, budget, half_life)


def evict(s: Scenario) -> EvictionResult:
    return plan_evictions(
        s.plan, s.budget, pinned=s.pinned, seconds_per_step=s.rates.__getitem__, now=NOW, half_life_s=s.half_life
    )


def on_path(plan: SearchPlan, q: Point, p: Point) -> bool:
    """Whether the model at q is one the path to p passes through (q == p included)."""
    if q == p:
        return True
    root = plan.path(p)[0][0]
    if q == Point(root, 0) and plan.nodes[root].parent is None:
        return True
    return any(q.node == n and a < q.step <= b for n, a, b in plan.path(p))


def greedy_oracle(s: Scenario) -> list[Point]:
    """The same policy without the heap: recompute every value from scratch before each eviction."""
    f = prefix_cost(s.plan.nodes, s.rates.__getitem__)
    kept = dict(s.plan.checkpoints)
    total = sum(c.bytes for c in kept.values())
    out: list[Point] = []
    while total > s.budget:
        best: tuple[float, Point] | None = None
        for p, c in kept.items():
            if p in s.pinned or c.bytes == 0:
                continue
            earlier = [f(q) for q in kept if q != p and on_path(s.plan, q, p)]
            cost = max(0.0, f(p) - (max(earlier) if earlier else 0.0))
            decay: float = 0.5 ** (max(0.0, NOW - c.last_used) / s.half_life)
            cand = (cost / c.bytes * decay, p)
            if best is None or cand < best:
                best = cand
        if best is None:
            break
        out.append(best[1])
        total -= kept.pop(best[1]).bytes
    return out


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_budget_pinning_and_bytes(s: Scenario) -> None:
    before = {p: c.bytes for p, c in s.plan.checkpoints.items()}
    total = sum(before.values())
    r = evict(s)
    assert len(set(r.evict)) == len(r.evict) and set(r.evict) <= set(before)
    assert not set(r.evict) & s.pinned, "a pinned checkpoint was evicted"
    assert r.bytes_after == total - sum(before[p] for p in r.evict) <= total
    unpinned = sum(b for p, b in before.items() if p not in s.pinned)
    if total - unpinned <= s.budget:
        assert r.bytes_after <= s.budget and r.shortfall == 0
    else:
        assert {p for p, b in before.items() if p not in s.pinned and b > 0} <= set(r.evict)
        assert r.shortfall == r.bytes_after - s.budget > 0
    if r.evict:  # nothing evicted beyond need: the last one was still required
        assert r.bytes_after + before[r.evict[-1]] > s.budget
    assert r.evict == greedy_oracle(s)


def request_sources(forest: StageForest) -> dict[int, Point]:
    out: dict[int, Point] = {}
    for st_ in forest.stages:
        for rid in st_.requests:
            cur = st_
            while cur.source is None:
                assert cur.parent is not None
                cur = forest.stages[cur.parent]
            out[rid] = cur.source
    return out


def build(s: Scenario, steps: dict[int, list[int]]) -> dict[int, Point]:
    forest = build_stage_tree(s.plan.nodes, steps, s.pending, plan="p")
    return request_sources(forest)


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_after_eviction_requests_start_from_an_earlier_kept_checkpoint(s: Scenario) -> None:
    old = build(s, s.plan.checkpoint_steps())
    r = evict(s)
    gone = set(r.evict)
    for p in r.evict:
        s.plan.drop_checkpoint(p)
    new = build(s, s.plan.checkpoint_steps())
    assert old.keys() == new.keys() == {rid for rid, _ in s.pending}
    for rid, p in s.pending:
        src0, src1 = old[rid], new[rid]
        assert on_path(s.plan, src1, p) and on_path(s.plan, src1, src0)
        assert src1 in s.plan.checkpoints or (src1.step == 0 and s.plan.nodes[src1.node].parent is None)
        fresh = src0.step == 0 and s.plan.nodes[src0.node].parent is None  # a fresh model needs no checkpoint
        if src0 in gone and not fresh:
            assert src1 != src0
        else:
            assert src1 == src0


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_pinning_the_stage_sources_leaves_the_stage_tree_unchanged(s: Scenario) -> None:
    forest = build_stage_tree(s.plan.nodes, s.plan.checkpoint_steps(), s.pending, plan="p")
    s.pinned = pinned_points(forest)
    old = request_sources(forest)
    r = evict(s)
    for p in r.evict:
        s.plan.drop_checkpoint(p)
    assert build(s, s.plan.checkpoint_steps()) == old
