"""Checkpoint cache policy (TreeML §4.2.2): which checkpoints to evict when storage runs over budget.

TreeML keeps central checkpoints (branch points, reused by child stages) and peripheral ones
(periodic, for recovery) in one cache and evicts by Nectar's cost-benefit ratio. Here a checkpoint's
*value* is

    (seconds to recompute it from the nearest earlier checkpoint on its path that stays,
     or from a fresh model when none stays) / bytes it holds  x  0.5 ** (age / half_life)

where age is the time since it was last used. The lowest value goes first, until the total is under
budget. Evicting a checkpoint makes every later checkpoint that leaned on it dearer to recompute (it
must now be trained from an earlier one), so those values are recomputed as we go: a min-heap with
lazy updates, entries whose value changed are pushed again and the stale ones skipped.

A *pinned* checkpoint (a pending request or a running batch starts, or will start, from it) is never
evicted; when the pinned ones alone exceed the budget, every other one goes and the result reports
the shortfall.

This module owns the policy only, as plain data in and out. The master's store carries the
evictions out (drops the rows, deletes the files) and decides when to run it.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

from stagetree.core.batch import Point
from stagetree.core.errors import InvalidArgument
from stagetree.core.searchplan import Checkpoint, SearchPlan
from stagetree.core.stagetree import StageForest

DEFAULT_HALF_LIFE_S = 3600.0

SecondsPerStep = float | Callable[[int], float]
"""Seconds one training step takes: one figure for the whole plan, or per search-plan node id (the
node's configuration decides its cost, e.g. through its batch size)."""


class NodeLike(Protocol):
    """What the cache needs to know of a search-plan node: where its path comes from."""

    @property
    def parent(self) -> int | None: ...

    @property
    def start(self) -> int: ...


@dataclass(frozen=True)
class EvictionResult:
    """``evict``: the points to drop, in the order chosen. ``bytes_after``: what the kept ones hold.
    ``shortfall``: bytes still over budget (0 when the budget is met; > 0 only when the pinned
    checkpoints alone exceed it)."""

    evict: list[Point]
    bytes_after: int
    shortfall: int


# ---------------------------------------------------------------------------------------------
# Recompute costs from a search plan


def _rate(seconds_per_step: SecondsPerStep, node: int) -> float:
    r = seconds_per_step(node) if callable(seconds_per_step) else seconds_per_step
    if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r) or r < 0:
        raise InvalidArgument(f"seconds per step of node {node}: must be a finite number >= 0, got {r!r}")
    return float(r)


def prefix_cost(nodes: Mapping[int, NodeLike], seconds_per_step: SecondsPerStep) -> Callable[[Point], float]:
    """``f(p)``: seconds to train a fresh model to point ``p`` along its whole path (each stretch at
    its own node's rate). This is the ``recompute_cost`` :func:`choose_evictions` takes."""
    base: dict[int, float] = {}  # node -> cost of the model at the node's start

    def node_base(nid: int) -> float:
        chain: list[int] = []
        cur: int | None = nid
        while cur is not None and cur not in base:
            chain.append(cur)
            cur = _node(nodes, cur).parent
        for n in reversed(chain):
            info = _node(nodes, n)
            if info.parent is None:
                base[n] = 0.0
            else:
                parent = _node(nodes, info.parent)
                base[n] = base[info.parent] + (info.start - parent.start) * _rate(seconds_per_step, info.parent)
        return base[nid]

    def cost(p: Point) -> float:
        info = _node(nodes, p.node)
        if p.step < info.start:
            raise InvalidArgument(f"point {tuple(p)} is before node {p.node}'s start {info.start}")
        return node_base(p.node) + (p.step - info.start) * _rate(seconds_per_step, p.node)

    return cost


def recompute_seconds(plan: SearchPlan, p: Point, seconds_per_step: SecondsPerStep) -> float:
    """Seconds to recompute the model at ``p`` from the nearest earlier checkpoint on its path in
    ``plan`` (from a fresh model when there is none): the steps in between times time per step."""
    p = plan.canonical(p)
    full = prefix_cost(plan.nodes, seconds_per_step)
    q = _nearest_earlier(p, plan.checkpoint_steps(), plan.nodes)
    return full(p) - (full(q) if q is not None else 0.0)


def pinned_points(forest: StageForest, running_sources: Iterable[Point] = ()) -> set[Point]:
    """The points work starts from: the sources of the stage forest's root stages (what pending
    requests will load) and the sources of running batches. Pass these as ``pinned``."""
    out = {st.source for st in forest.stages if st.source is not None}
    out.update(running_sources)
    return out


# ---------------------------------------------------------------------------------------------
# The policy


def choose_evictions(
    checkpoints: Mapping[Point, Checkpoint] | Iterable[Checkpoint],
    budget_bytes: int,
    *,
    pinned: AbstractSet[Point],
    recompute_cost: Callable[[Point], float],
    now: float,
    nodes: Mapping[int, NodeLike] | None = None,
    half_life_s: float = DEFAULT_HALF_LIFE_S,
) -> EvictionResult:
    """The checkpoints to evict so that the rest fit in ``budget_bytes``, lowest value first.

    ``recompute_cost(p)`` is the cost of training a fresh model to ``p`` (its whole prefix, as
    :func:`prefix_cost` gives); the cost of recomputing ``p`` is that minus the same for the nearest
    earlier checkpoint on its path that stays. ``nodes`` (node id -> parent and start, e.g.
    ``plan.nodes``) says which checkpoints lie on a path across nodes; without it only earlier
    checkpoints on the same node count, so a checkpoint on a child node is valued as if recomputed
    from scratch (kept longer than it deserves, never dropped too eagerly). Points are canonical
    search-plan points. Checkpoints holding 0 bytes are never evicted: dropping them frees nothing.
    """
    ckpts = _as_dict(checkpoints)
    if nodes is not None:
        for p in ckpts:
            info = _node(nodes, p.node)
            if p.step < info.start or (p.step == info.start and info.parent is not None):
                raise InvalidArgument(
                    f"checkpoint at {tuple(p)} is not a canonical point of node {p.node} (it starts at {info.start})"
                )
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise InvalidArgument(f"budget_bytes: must be an integer >= 0, got {budget_bytes!r}")
    if not _finite(now):
        raise InvalidArgument(f"now: must be a finite number of seconds, got {now!r}")
    if not _finite(half_life_s) or half_life_s <= 0:
        raise InvalidArgument(f"half_life_s: must be a finite number > 0, got {half_life_s!r}")
    total = sum(c.bytes for c in ckpts.values())
    if total <= budget_bytes:
        return EvictionResult([], total, 0)

    full: dict[Point, float] = {}
    for p in ckpts:
        c = recompute_cost(p)
        if not _finite(c) or c < 0:
            raise InvalidArgument(f"recompute_cost({tuple(p)}): must be a finite number >= 0, got {c!r}")
        full[p] = float(c)

    steps_by_node: dict[int, list[int]] = {}
    for p in ckpts:
        steps_by_node.setdefault(p.node, []).append(p.step)
    for steps in steps_by_node.values():
        steps.sort()
    base: dict[Point, Point | None] = {}  # nearest earlier checkpoint still kept
    leaning: dict[Point, list[Point]] = {}  # inverse of base
    for p in ckpts:
        q = _nearest_earlier(p, steps_by_node, nodes)
        base[p] = q
        if q is not None:
            leaning.setdefault(q, []).append(p)

    def value(p: Point) -> float:
        b = base[p]
        cost = max(0.0, full[p] - (full[b] if b is not None else 0.0))
        ck = ckpts[p]
        age = max(0.0, now - ck.last_used)
        decay: float = 0.5 ** (age / half_life_s)
        return cost / ck.bytes * decay

    current = {p: value(p) for p, ck in ckpts.items() if p not in pinned and ck.bytes > 0}
    heap = [(v, p) for p, v in current.items()]
    heapq.heapify(heap)
    evict: list[Point] = []
    while total > budget_bytes and heap:
        v, p = heapq.heappop(heap)
        if current.get(p) != v:
            continue  # stale: evicted already, or its value rose since this entry was pushed
        del current[p]
        evict.append(p)
        total -= ckpts[p].bytes
        up = base[p]
        for k in leaning.pop(p, []):
            base[k] = up
            if up is not None:
                leaning.setdefault(up, []).append(k)
            if k in current:
                current[k] = nv = value(k)
                heapq.heappush(heap, (nv, k))
    return EvictionResult(evict, total, max(0, total - budget_bytes))


def plan_evictions(
    plan: SearchPlan,
    budget_bytes: int,
    *,
    pinned: AbstractSet[Point],
    seconds_per_step: SecondsPerStep,
    now: float,
    half_life_s: float = DEFAULT_HALF_LIFE_S,
) -> EvictionResult:
    """:func:`choose_evictions` over one search plan's checkpoints, with its path structure."""
    return choose_evictions(
        plan.checkpoints,
        budget_bytes,
        pinned=pinned,
        recompute_cost=prefix_cost(plan.nodes, seconds_per_step),
        now=now,
        nodes=plan.nodes,
        half_life_s=half_life_s,
    )


# ---------------------------------------------------------------------------------------------
# Helpers


def _finite(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x)


def _node(nodes: Mapping[int, NodeLike], nid: int) -> NodeLike:
    info = nodes.get(nid)
    if info is None:
        raise InvalidArgument(f"search-plan node {nid} is unknown; pass the plan's nodes that hold its checkpoints")
    return info


def _as_dict(checkpoints: Mapping[Point, Checkpoint] | Iterable[Checkpoint]) -> dict[Point, Checkpoint]:
    items = checkpoints.values() if isinstance(checkpoints, Mapping) else checkpoints
    out: dict[Point, Checkpoint] = {}
    for ck in items:
        if ck.point in out:
            raise InvalidArgument(f"checkpoint at {tuple(ck.point)} given twice")
        if isinstance(ck.bytes, bool) or not isinstance(ck.bytes, int) or ck.bytes < 0:
            raise InvalidArgument(f"checkpoint at {tuple(ck.point)}: bytes must be an integer >= 0, got {ck.bytes!r}")
        if not _finite(ck.last_used):
            raise InvalidArgument(f"checkpoint at {tuple(ck.point)}: last_used must be finite, got {ck.last_used!r}")
        out[ck.point] = ck
    return out


def _nearest_earlier(
    p: Point, steps_by_node: Mapping[int, list[int]], nodes: Mapping[int, NodeLike] | None
) -> Point | None:
    """The latest point strictly before ``p`` on its path that appears in ``steps_by_node``."""
    if nodes is None:
        same = steps_by_node.get(p.node, [])
        j = bisect.bisect_left(same, p.step) - 1
        return Point(p.node, same[j]) if j >= 0 else None
    nid, bound, inclusive = p.node, p.step, False
    while True:
        info = _node(nodes, nid)
        steps = steps_by_node.get(nid)
        if steps:
            i = (bisect.bisect_right(steps, bound) if inclusive else bisect.bisect_left(steps, bound)) - 1
            if i >= 0:  # points are canonical: every step held on a node is past its start
                return Point(nid, steps[i])
        if info.parent is None:
            return None
        nid, bound, inclusive = info.parent, info.start, True
